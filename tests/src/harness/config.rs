//! Config files for the end-to-end tests, built from the shapes they share instead of written
//! out by hand: hosts (Ollama, or engines as `kind: openai`), keys with their clients, the
//! state directory, and any section a test writes itself.
//!
//! ```
//! use oqp_tests::harness::{ConfigYaml, Host, Key};
//! let yaml = ConfigYaml::new()
//!     .max_concurrent(4)
//!     .host(Host::openai("e0", "http://127.0.0.1:8080").set("max_concurrent", 2))
//!     .strategy("model_aware")
//!     .key(Key::new("oqp_k", "user").set("models", r#"["llama3*"]"#))
//!     .yaml();
//! assert!(yaml.contains("kind: openai"));
//! ```

use std::path::Path;

/// A config file, section by section, in the order sections are first named.
#[derive(Debug, Clone, Default)]
pub struct ConfigYaml {
    /// Each section's name and its lines (indented, each ending in a newline).
    sections: Vec<(String, String)>,
    /// The items of `ollama.hosts`.
    hosts: String,
    /// The items of `auth.keys`.
    keys: String,
    /// Sections written whole by the test, after the others.
    raw: String,
}

/// One entry of `ollama.hosts`.
#[derive(Debug, Clone)]
pub struct Host {
    fields: Vec<(String, String)>,
}

/// One entry of `auth.keys`.
#[derive(Debug, Clone)]
pub struct Key {
    fields: Vec<(String, String)>,
}

impl ConfigYaml {
    /// An empty config.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `lines` (indented by two spaces, each ending in a newline) at the end of
    /// `section`.
    pub fn under(mut self, section: &str, lines: &str) -> Self {
        match self.sections.iter_mut().find(|(name, _)| name == section) {
            Some((_, body)) => body.push_str(lines),
            None => self.sections.push((section.to_owned(), lines.to_owned())),
        }
        self
    }

    /// `proxy.max_concurrent`.
    pub fn max_concurrent(self, slots: u32) -> Self {
        self.under("proxy", &format!("  max_concurrent: {slots}\n"))
    }

    /// `control_plane.state_dir`.
    pub fn state_dir(self, dir: &Path) -> Self {
        self.under(
            "control_plane",
            &format!("  state_dir: \"{}\"\n", dir.display()),
        )
    }

    /// An entry of `ollama.hosts`.
    pub fn host(mut self, host: Host) -> Self {
        self.hosts.push_str(&item("    ", &host.fields));
        self.under("ollama", "")
    }

    /// `routing.strategy`.
    pub fn strategy(self, strategy: &str) -> Self {
        self.under("routing", &format!("  strategy: {strategy}\n"))
    }

    /// An entry of `auth.keys`; with any, auth is on.
    pub fn key(mut self, key: Key) -> Self {
        self.keys.push_str(&item("    ", &key.fields));
        self.under("auth", "")
    }

    /// Sections the test writes whole (top-level keys, each ending in a newline), after the
    /// others.
    pub fn raw(mut self, yaml: &str) -> Self {
        self.raw.push_str(yaml);
        self
    }

    /// The file's text.
    pub fn yaml(&self) -> String {
        let mut out = String::new();
        for (name, body) in &self.sections {
            out.push_str(name);
            out.push_str(":\n");
            match name.as_str() {
                "ollama" if !self.hosts.is_empty() => {
                    out.push_str(body);
                    out.push_str("  hosts:\n");
                    out.push_str(&self.hosts);
                }
                "auth" if !self.keys.is_empty() => {
                    out.push_str("  enabled: true\n");
                    out.push_str(body);
                    out.push_str("  keys:\n");
                    out.push_str(&self.keys);
                }
                _ => out.push_str(body),
            }
        }
        out.push_str(&self.raw);
        out
    }
}

impl Host {
    /// An Ollama host named `name` at `url`.
    pub fn ollama(name: &str, url: &str) -> Self {
        Self {
            fields: vec![
                ("url".to_owned(), format!("\"{url}\"")),
                ("name".to_owned(), name.to_owned()),
            ],
        }
    }

    /// An engine (llama-server, vLLM…) named `name` at `url`: `kind: openai`, polled every
    /// second.
    pub fn openai(name: &str, url: &str) -> Self {
        Self::ollama(name, url)
            .set("kind", "openai")
            .set("model_sync_interval", 1)
    }

    /// Sets `field` to `value` (written as YAML).
    pub fn set(mut self, field: &str, value: impl ToString) -> Self {
        set(&mut self.fields, field, value.to_string());
        self
    }
}

impl Key {
    /// The key `key` of the client `client_id`.
    pub fn new(key: &str, client_id: &str) -> Self {
        Self {
            fields: vec![
                ("key".to_owned(), format!("\"{key}\"")),
                ("client_id".to_owned(), client_id.to_owned()),
            ],
        }
    }

    /// Sets `field` to `value` (written as YAML).
    pub fn set(mut self, field: &str, value: impl ToString) -> Self {
        set(&mut self.fields, field, value.to_string());
        self
    }
}

fn set(fields: &mut Vec<(String, String)>, field: &str, value: String) {
    match fields.iter_mut().find(|(name, _)| name == field) {
        Some((_, old)) => *old = value,
        None => fields.push((field.to_owned(), value)),
    }
}

/// A list item of `fields`, its dash at `indent`.
fn item(indent: &str, fields: &[(String, String)]) -> String {
    let mut out = String::new();
    for (index, (name, value)) in fields.iter().enumerate() {
        let lead = if index == 0 { "- " } else { "  " };
        out.push_str(&format!("{indent}{lead}{name}: {value}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_gather_their_lines_in_the_order_first_named() {
        let yaml = ConfigYaml::new()
            .max_concurrent(4)
            .host(Host::openai("e0", "http://a").set("max_concurrent", 2))
            .host(Host::ollama("gpu", "http://b"))
            .strategy("model_aware")
            .under("routing", "  model_poll_timeout: 2\n")
            .key(Key::new("k1", "user"))
            .key(Key::new("k2", "batch").set("max_priority", "low"))
            .raw("embedding_cache:\n  enabled: false\n")
            .yaml();
        assert_eq!(
            yaml,
            "proxy:\n  max_concurrent: 4\n\
             ollama:\n  hosts:\n    - url: \"http://a\"\n      name: e0\n      kind: openai\n      model_sync_interval: 1\n      max_concurrent: 2\n\
             \x20   - url: \"http://b\"\n      name: gpu\n\
             routing:\n  strategy: model_aware\n  model_poll_timeout: 2\n\
             auth:\n  enabled: true\n  keys:\n    - key: \"k1\"\n      client_id: user\n\
             \x20   - key: \"k2\"\n      client_id: batch\n      max_priority: low\n\
             embedding_cache:\n  enabled: false\n"
        );
        let parsed: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        // Lines of a section named before its first host or key stay in it.
        let limited = ConfigYaml::new()
            .under("auth", "  rate_limit:\n    max_failures: 3\n")
            .key(Key::new("k1", "user"))
            .yaml();
        assert_eq!(
            limited,
            "auth:\n  enabled: true\n  rate_limit:\n    max_failures: 3\n  keys:\n    - key: \"k1\"\n      client_id: user\n"
        );
        assert_eq!(parsed["ollama"]["hosts"][0]["kind"], "openai");
        assert_eq!(parsed["auth"]["keys"][1]["max_priority"], "low");
    }
}
