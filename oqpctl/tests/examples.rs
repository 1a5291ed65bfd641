//! The two-box deployment as documented: the config block of README's
//! "Several GPU boxes" and `examples/two-boxes/` pass `oqpctl config check`
//! with their key files in place, and the compose files fit the config.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use oqp_controlplane::config::{Config, Env};

/// A temporary directory for a config and its key files.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> Self {
        Self(tempfile::tempdir().unwrap())
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    /// Writes a key file readable by its owner only (a wider one is warned about).
    fn secret(&self, name: &str) {
        let path = self.path().join(name);
        std::fs::write(&path, format!("{name}-0123456789abcdef\n")).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
    }
}

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repository().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The YAML block under `marker` in the README.
fn readme_block(marker: &str) -> String {
    let readme = read("README.md");
    let after = &readme[readme.find(marker).expect("the README marks the block")..];
    let start = after
        .find("```yaml\n")
        .expect("a yaml block follows the marker")
        + 8;
    let end = after[start..].find("```").unwrap();
    after[start..start + end].to_owned()
}

/// Runs `oqpctl config check` on `yaml` (with `secrets_dir` standing in for
/// `dir/` in key paths), asserts it is valid, and loads it.
fn check(yaml: &str, secrets_dir: &str, scratch: &Scratch) -> Config {
    let yaml = yaml.replace(secrets_dir, &format!("{}/", scratch.path().display()));
    let path = scratch.path().join("config.yml");
    std::fs::write(&path, yaml).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .args(["config", "check", "--output", "json"])
        .arg(&path)
        .env_clear()
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stderr)));
    assert_eq!(report["valid"], true, "{report}");
    oqp_controlplane::config::load_file(&path, &Env::empty())
        .unwrap()
        .config
}

/// Both boxes own their host, and both are listed with a peer URL.
fn assert_two_boxes(config: &Config) {
    let owners: Vec<(&str, Option<&str>)> = config
        .ollama
        .hosts
        .iter()
        .map(|host| (host.name.as_str(), host.node.as_deref()))
        .collect();
    assert_eq!(owners, [("gpu1", Some("box1")), ("gpu2", Some("box2"))]);
    let urls: Vec<(&str, Option<&str>)> = config
        .nodes
        .iter()
        .map(|(name, node)| (name.as_str(), node.url.as_deref()))
        .collect();
    assert_eq!(
        urls,
        [
            ("box1", Some("http://192.168.1.11:11435")),
            ("box2", Some("http://192.168.1.12:11435"))
        ]
    );
    assert!(config.control_plane.node_token.is_some());
    assert!(config.auth.enabled);
}

#[test]
fn the_readme_two_box_config_checks() {
    let scratch = Scratch::new();
    for key in ["admin.key", "chat.key", "batch.key", "node-token"] {
        scratch.secret(key);
    }
    let yaml = readme_block("<!-- two-box config: oqpctl/tests/examples.rs loads this block -->");
    let config = check(&yaml, "/etc/oqp/keys/", &scratch);
    assert_two_boxes(&config);
}

#[test]
fn config_check_names_a_host_without_its_owner() {
    let scratch = Scratch::new();
    for key in ["admin.key", "chat.key", "batch.key", "node-token"] {
        scratch.secret(key);
    }
    let yaml = readme_block("<!-- two-box config: oqpctl/tests/examples.rs loads this block -->")
        .replace("      node: box2\n", "")
        .replace("/etc/oqp/keys/", &format!("{}/", scratch.path().display()));
    let path = scratch.path().join("config.yml");
    std::fs::write(&path, yaml).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_oqpctl"))
        .args(["config", "check"])
        .arg(&path)
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("ollama.hosts[1].node"), "{stderr}");
}

#[test]
fn the_two_box_compose_example_checks_and_fits_its_config() {
    let scratch = Scratch::new();
    let control: serde_yaml::Value =
        serde_yaml::from_str(&read("examples/two-boxes/control.compose.yml")).unwrap();
    let secrets: Vec<&str> = control["secrets"]
        .as_mapping()
        .unwrap()
        .keys()
        .filter_map(|name| name.as_str())
        .collect();
    for secret in &secrets {
        scratch.secret(secret);
    }
    let config = check(
        &read("examples/two-boxes/config.yml"),
        "/run/secrets/",
        &scratch,
    );
    assert_two_boxes(&config);

    // The control plane runs alone, on the config above, with every secret it names.
    let service = &control["services"]["controlplane"];
    let command: Vec<&str> = service["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|arg| arg.as_str())
        .collect();
    assert_eq!(command, ["--config", "/etc/oqp/config.yml"]);
    assert!(
        service["volumes"][0]
            .as_str()
            .unwrap()
            .starts_with("./config.yml:/etc/oqp/config.yml")
    );
    let config_text = read("examples/two-boxes/config.yml");
    for secret in &secrets {
        assert!(
            config_text.contains(&format!("/run/secrets/{secret}")),
            "config.yml does not use {secret}"
        );
    }

    // Each box: a data plane named by OQP_NODE, with the node token, on the
    // port the nodes' URLs name.
    let boxes: serde_yaml::Value =
        serde_yaml::from_str(&read("examples/two-boxes/box.compose.yml")).unwrap();
    let dataplane = &boxes["services"]["dataplane"];
    assert_eq!(dataplane["entrypoint"][0], "oqp-dataplane");
    let command: Vec<&str> = dataplane["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|arg| arg.as_str())
        .collect();
    let flag = |name: &str| {
        let at = command.iter().position(|arg| *arg == name).unwrap();
        command[at + 1]
    };
    assert!(flag("--node").starts_with("${OQP_NODE"));
    assert!(flag("--control-plane").starts_with("${OQP_CONTROL_PLANE"));
    assert_eq!(flag("--node-token-file"), "/run/secrets/oqp_node_token");
    assert_eq!(dataplane["ports"][0], "11435:11435");
    assert_eq!(config.proxy.port, 11435);
    assert_eq!(
        boxes["secrets"]["oqp_node_token"]["file"],
        control["secrets"]["oqp_node_token"]["file"]
    );
}

/// The clients' examples (Open WebUI, the agents, the SDKs) point at the port the proxy
/// listens on, not at Ollama's.
#[test]
fn client_examples_use_the_proxy_port() {
    let scratch = Scratch::new();
    let quickstart = check(&read("examples/quickstart.yml"), "dir/", &scratch);
    let port = quickstart.proxy.port;
    assert_eq!(port, 11435);
    let readme = read("README.md");
    let mut seen = 0;
    for (at, _) in readme.match_indices("://oqp:") {
        let rest = &readme[at + "://oqp:".len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        assert_eq!(
            digits,
            port.to_string(),
            "a client example points at oqp:{digits}: {}",
            &readme[at.saturating_sub(40)..at + 20]
        );
        seen += 1;
    }
    assert!(
        seen >= 5,
        "the Open WebUI and agents examples name the proxy"
    );
}
