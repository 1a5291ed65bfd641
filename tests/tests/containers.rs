//! The container recipes as far as they can be checked without a Docker daemon: the root
//! `Dockerfile` read as text, `.dockerignore`, and every compose file parsed as YAML and held
//! against the oqp config it mounts.
//!
//! What broke `docker compose up` before is asserted here: a service that drops every
//! capability while its image must switch user at start (Valkey's entrypoint does, as root),
//! Ollama on the host unreachable, key files unreadable by the container's user, oqp starting
//! before its cache, no health checks, a build context holding `target/`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_yaml::Value;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repository().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> Value {
    serde_yaml::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// The binaries a crate builds: its `[[bin]]` names, else its package name when it has a
/// `src/main.rs`.
fn binaries_of(krate: &str) -> Vec<String> {
    let manifest = read(&format!("{krate}/Cargo.toml"));
    let mut names = Vec::new();
    let mut section = String::new();
    let mut package = None;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_owned();
            continue;
        }
        let Some(value) = line
            .strip_prefix("name")
            .map(str::trim_start)
            .and_then(|rest| rest.strip_prefix('='))
            .map(|value| value.trim().trim_matches('"').to_owned())
        else {
            continue;
        };
        match section.as_str() {
            "[[bin]]" => names.push(value),
            "[package]" => package = Some(value),
            _ => {}
        }
    }
    if names.is_empty() && repository().join(krate).join("src/main.rs").is_file() {
        names.extend(package);
    }
    names
}

/// The binaries oqp ships: those of the crates a deployment runs (not the test tools).
fn shipped_binaries() -> BTreeSet<String> {
    let names: BTreeSet<String> = ["controlplane", "dataplane", "oqpctl"]
        .into_iter()
        .flat_map(binaries_of)
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    names
}

/// One `FROM` stage of a Dockerfile: its image, its name and its instructions (continuation
/// lines joined, comments dropped).
#[derive(Debug)]
struct Stage {
    image: String,
    name: Option<String>,
    instructions: Vec<String>,
}

impl Stage {
    fn all(&self, keyword: &str) -> Vec<&str> {
        self.instructions
            .iter()
            .filter_map(|line| {
                let (word, rest) = line.split_once(char::is_whitespace)?;
                word.eq_ignore_ascii_case(keyword).then_some(rest.trim())
            })
            .collect()
    }
}

fn stages(dockerfile: &str) -> Vec<Stage> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || trimmed.is_empty() {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    let mut stages: Vec<Stage> = Vec::new();
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words[0].eq_ignore_ascii_case("FROM") {
            let name = (words.len() == 4 && words[2].eq_ignore_ascii_case("AS"))
                .then(|| words[3].to_owned());
            stages.push(Stage {
                image: words[1].to_owned(),
                name,
                instructions: Vec::new(),
            });
        } else {
            stages
                .last_mut()
                .expect("FROM comes first")
                .instructions
                .push(line);
        }
    }
    stages
}

/// Whether a compose `user` (or a Dockerfile `USER`) names root.
fn is_root(user: &str) -> bool {
    let name = user.split(':').next().unwrap_or_default();
    name.is_empty() || name == "root" || name == "0"
}

#[test]
fn the_dockerfile_builds_the_dist_binaries_and_runs_them_unprivileged() {
    let dockerfile = read("Dockerfile");
    let stages = stages(&dockerfile);
    assert_eq!(stages.len(), 2, "a builder and a runtime: {stages:?}");
    let (builder, runtime) = (&stages[0], &stages[1]);

    assert!(builder.image.starts_with("rust:"), "{}", builder.image);
    let builder_name = builder.name.as_deref().expect("the builder stage is named");
    let build = builder.all("RUN").join(" ");
    for flag in ["cargo build", "--locked", "--profile dist"] {
        assert!(build.contains(flag), "the build runs with {flag}: {build}");
    }
    // Every shipped binary is built, taken from the dist profile and copied; nothing else.
    let shipped = shipped_binaries();
    let taken: BTreeSet<String> = build
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("target/dist/"))
        .map(str::to_owned)
        .collect();
    assert_eq!(taken, shipped, "the binaries installed from target/dist");
    let packages: BTreeSet<&str> = build
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|pair| pair[0] == "-p")
        .map(|pair| pair[1])
        .collect();
    for package in ["oqp-controlplane", "oqp-dataplane", "oqpctl"] {
        assert!(packages.contains(package), "-p {package}");
    }

    // The runtime: a small base, the binaries only, not root.
    assert!(
        runtime.image.contains("-slim") || runtime.image.contains("distroless"),
        "{}",
        runtime.image
    );
    let copies = runtime.all("COPY");
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert!(
        copies[0].starts_with(&format!("--from={builder_name} ")),
        "only what the builder made: {copies:?}"
    );
    let users = runtime.all("USER");
    let user = users.last().expect("the runtime sets USER");
    assert!(!is_root(user), "USER {user}");
    let exposed: Vec<&str> = runtime
        .all("EXPOSE")
        .iter()
        .flat_map(|ports| ports.split_whitespace())
        .collect();
    assert!(exposed.contains(&"11435") && exposed.contains(&"50051"));

    // Its health check runs a binary the image has, on the proxy's /health.
    let checks = runtime.all("HEALTHCHECK");
    assert_eq!(checks.len(), 1, "{checks:?}");
    let command = &checks[0][checks[0].find("CMD").expect("HEALTHCHECK … CMD")..];
    let exec: Vec<String> = serde_json::from_str(command.trim_start_matches("CMD").trim())
        .expect("the exec form: no shell needed in the image");
    assert!(shipped.contains(&exec[0]), "{exec:?}");
    assert_eq!(exec[1], "health");
    assert_eq!(exec[2], "http://127.0.0.1:11435/health");

    let entrypoint = runtime.all("ENTRYPOINT");
    assert_eq!(entrypoint, ["[\"oqp-controlplane\"]"]);
}

#[test]
fn the_build_context_leaves_out_build_output_and_secrets() {
    let ignore = read(".dockerignore");
    let patterns: BTreeSet<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| line.trim_start_matches('/'))
        .collect();
    for needed in [
        "target",
        "fuzz/target",
        ".venv",
        ".git",
        "bench-results",
        "**/secrets",
    ] {
        assert!(patterns.contains(needed), "{needed} not in {patterns:?}");
    }
    // Nothing the build needs is left out.
    for kept in [
        "Cargo.toml",
        "Cargo.lock",
        "proto",
        "dataplane",
        "controlplane",
    ] {
        assert!(!patterns.contains(kept), "{kept} is ignored");
    }
}

/// A compose file and the oqp config its oqp service mounts.
struct Deployment {
    compose: Value,
    dir: &'static str,
    config: Value,
}

impl Deployment {
    fn load(compose: &'static str, config: &str) -> Self {
        let dir = Path::new(compose).parent().unwrap().to_str().unwrap();
        Self {
            compose: yaml(compose),
            dir: Box::leak(dir.to_owned().into_boxed_str()),
            config: yaml(config),
        }
    }

    fn services(&self) -> &serde_yaml::Mapping {
        self.compose["services"].as_mapping().expect("services")
    }

    fn service(&self, name: &str) -> &Value {
        &self.compose["services"][name]
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|item| item.as_str().expect("a string").to_owned())
        .collect()
}

/// The checks every service of every compose file passes.
fn assert_services_start(deployment: &Deployment) {
    for (name, service) in deployment.services() {
        let name = name.as_str().unwrap();
        let user = service["user"].as_str();
        // Dropping every capability is right only for a process that never switches user:
        // an image whose entrypoint starts as root and switches (Valkey's, Redis') needs
        // SETUID and SETGID for that. Such services run as their user from the start.
        if strings(&service["cap_drop"]).iter().any(|cap| cap == "ALL") {
            let user = user.unwrap_or_else(|| panic!("{name}: cap_drop ALL without a user"));
            assert!(!is_root(user), "{name}: cap_drop ALL as root ({user})");
        }
        assert!(
            service["healthcheck"]["test"].is_sequence(),
            "{name} has a health check"
        );
        // An oqp image is built from the repository root's Dockerfile.
        if let Some(build) = service["build"].as_mapping() {
            let context = build
                .get("context")
                .and_then(Value::as_str)
                .expect("a build context");
            let dockerfile = build
                .get("dockerfile")
                .and_then(Value::as_str)
                .expect("a dockerfile");
            let path = repository()
                .join(deployment.dir)
                .join(context)
                .join(dockerfile);
            assert_eq!(
                path.canonicalize().unwrap(),
                repository().join("Dockerfile").canonicalize().unwrap(),
                "{name}: builds the root Dockerfile"
            );
            let user = user.unwrap_or_else(|| panic!("{name}: the user is named"));
            assert!(!is_root(user), "{name}: runs as {user}");
        }
    }
}

/// The `oqpctl health` URL of a service's health check.
fn health_url(service: &Value) -> String {
    let test = strings(&service["healthcheck"]["test"]);
    assert_eq!(&test[..3], ["CMD", "oqpctl", "health"], "{test:?}");
    test[3].clone()
}

/// The container ports a service publishes.
fn container_ports(service: &Value) -> Vec<u16> {
    strings(&service["ports"])
        .iter()
        .map(|port| port.rsplit(':').next().unwrap().parse().unwrap())
        .collect()
}

/// Every `/run/secrets/<name>` the config names.
fn secrets_named(config: &str) -> BTreeSet<String> {
    config
        .split("/run/secrets/")
        .skip(1)
        .map(|rest| {
            rest.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .next()
                .unwrap()
                .to_owned()
        })
        .collect()
}

fn assert_secrets_provided(deployment: &Deployment, service: &str, config_path: &str) {
    let given: BTreeSet<String> = strings(&deployment.service(service)["secrets"])
        .into_iter()
        .collect();
    let named = secrets_named(&read(config_path));
    assert!(!named.is_empty());
    for secret in &named {
        assert!(given.contains(secret), "{service} lacks secret {secret}");
        assert!(
            deployment.compose["secrets"][secret.as_str()]["file"].is_string(),
            "secret {secret} comes from a file"
        );
    }
}

#[test]
fn the_single_box_compose_file_works_as_written() {
    let deployment = Deployment::load("examples/docker-compose.yml", "examples/docker/config.yml");
    assert_services_start(&deployment);
    let oqp = deployment.service("oqp");
    let valkey = deployment.service("valkey");
    let config = &deployment.config;

    // Valkey: started as its own user, with a health check oqp waits for.
    assert_eq!(valkey["user"], "valkey");
    assert_eq!(
        strings(&valkey["healthcheck"]["test"]),
        ["CMD", "valkey-cli", "ping"]
    );
    assert_eq!(oqp["depends_on"]["valkey"]["condition"], "service_healthy");
    let backend = config["embedding_cache"]["backend"].as_str().unwrap();
    assert!(backend.starts_with("redis://valkey:"), "{backend}");

    // The config is mounted where the command reads it; the state directory is a volume.
    let command = strings(&oqp["command"]);
    let at = command.iter().position(|arg| arg == "--config").unwrap();
    let volumes = strings(&oqp["volumes"]);
    assert!(
        volumes.contains(&format!("./docker/config.yml:{}:ro", command[at + 1])),
        "{volumes:?}"
    );
    assert!(command.contains(&"--with-dataplane".to_owned()));
    let state_dir = config["control_plane"]["state_dir"].as_str().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v.ends_with(&format!(":{state_dir}"))),
        "{volumes:?}"
    );

    // Ports: the proxy and the control plane as the config has them, on loopback only,
    // and the health check on the proxy's port.
    let proxy_port = config["proxy"]["port"].as_u64().unwrap() as u16;
    assert_eq!(proxy_port, 11435);
    let grpc_port: u16 = config["control_plane"]["listen"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(container_ports(oqp), [proxy_port, grpc_port]);
    for port in strings(&oqp["ports"]) {
        assert!(port.starts_with("127.0.0.1:"), "{port} beyond loopback");
    }
    assert_eq!(
        health_url(oqp),
        format!("http://127.0.0.1:{proxy_port}/health")
    );

    // Ollama on the Docker host, through the host gateway.
    let url = config["ollama"]["hosts"][0]["url"].as_str().unwrap();
    assert!(url.starts_with("http://host.docker.internal:"), "{url}");
    assert_eq!(
        strings(&oqp["extra_hosts"]),
        ["host.docker.internal:host-gateway"]
    );

    // Keys: every file the config reads is a secret; the instructions share them with the
    // container's group, and never say chmod 600 (unreadable in the container) or 644.
    assert_secrets_provided(&deployment, "oqp", "examples/docker/config.yml");
    let text = read("examples/docker-compose.yml");
    assert!(text.contains("OLLAMA_HOST=0.0.0.0:11434"));
    assert!(text.contains("chown \"$(id -u)\":10001 secrets/*.key && chmod 640 secrets/*.key"));
    assert!(!text.contains("chmod 600") && !text.contains("chmod 644"));
    assert!(read("Dockerfile").contains("--uid 10001 --gid oqp"));
    assert!(read("Dockerfile").contains("--gid 10001 oqp"));
}

#[test]
fn the_two_box_compose_files_work_as_written() {
    let control = Deployment::load(
        "examples/two-boxes/control.compose.yml",
        "examples/two-boxes/config.yml",
    );
    assert_services_start(&control);
    let service = control.service("controlplane");
    assert!(!strings(&service["command"]).contains(&"--with-dataplane".to_owned()));
    let listen = control.config["control_plane"]["listen"].as_str().unwrap();
    let grpc_port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(container_ports(service), [grpc_port]);
    assert_eq!(health_url(service), format!("tcp://127.0.0.1:{grpc_port}"));
    assert_secrets_provided(&control, "controlplane", "examples/two-boxes/config.yml");

    let boxes = Deployment::load(
        "examples/two-boxes/box.compose.yml",
        "examples/two-boxes/config.yml",
    );
    assert_services_start(&boxes);
    let service = boxes.service("dataplane");
    assert_eq!(strings(&service["entrypoint"]), ["oqp-dataplane"]);
    let proxy_port = boxes.config["proxy"]["port"].as_u64().unwrap() as u16;
    assert_eq!(container_ports(service), [proxy_port]);
    assert_eq!(
        health_url(service),
        format!("http://127.0.0.1:{proxy_port}/health")
    );
    for path in [
        "examples/two-boxes/control.compose.yml",
        "examples/two-boxes/box.compose.yml",
    ] {
        let text = read(path);
        assert!(text.contains("chmod 640"), "{path}");
        assert!(!text.contains("chmod 600"), "{path}");
    }
    assert!(read("examples/two-boxes/box.compose.yml").contains("OLLAMA_HOST=0.0.0.0:11434"));
}

#[test]
fn the_stage_reader_reads_what_docker_reads() {
    let stages = stages(
        "# c\nFROM a:1 AS b\nRUN x \\\n  y\n\nFROM c\n# USER root\nUSER u:g\nHEALTHCHECK CMD [\"p\"]\n",
    );
    assert_eq!(stages.len(), 2);
    assert_eq!(stages[0].name.as_deref(), Some("b"));
    assert_eq!(stages[0].all("RUN"), ["x  y"]);
    assert_eq!(stages[1].image, "c");
    assert_eq!(stages[1].all("USER"), ["u:g"]);
    assert!(is_root("0:0") && is_root("root") && !is_root("10001:10001"));
    assert_eq!(
        binaries_of("dataplane"),
        ["oqp-dataplane"],
        "[[bin]] names are read"
    );
    assert_eq!(binaries_of("oqpctl"), ["oqpctl"], "else the package's name");
}
