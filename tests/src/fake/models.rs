//! The fake's model registry: which models are installed, which are loaded and until when, how a
//! request's model string matches an installed name (a missing `:latest` is accepted and case is
//! ignored, reference §A.1), and the JSON shapes of `/api/tags`, `/api/ps`, `/api/show` and
//! `/v1/models` entries (§A.3.3–A.3.5, §A.8).

use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use super::gojson::KeepAlive;
use super::vram::Listed;
use super::wire::{hash64, rfc3339, splitmix, unix_seconds};

/// How long a model stays loaded when the request says nothing (`OLLAMA_KEEP_ALIVE`).
const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(300);
/// "Forever": what Go prints for a model pinned with a negative keep-alive is far in the future.
const FOREVER: Duration = Duration::from_secs(200 * 365 * 24 * 3600);
/// The context length the fake reports for every model.
const CONTEXT_LENGTH: u64 = 4096;

/// What a model can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Completion and chat.
    Chat,
    /// Embeddings only: generate and chat are refused.
    Embedding,
}

/// One installed model.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    /// The installed name, always with a tag (`llama3.2:latest`), in the case it was given.
    pub name: String,
    pub kind: Kind,
    pub modified_at: SystemTime,
    /// Loaded until this time; `None` when not loaded.
    pub loaded_until: Option<SystemTime>,
    /// `model_info."general.architecture"` when set (else by kind).
    pub architecture: Option<String>,
}

/// The installed models, in installation order.
#[derive(Debug, Default)]
pub(crate) struct Models {
    list: Vec<Model>,
}

impl Models {
    /// Installs a model, or changes the kind of an installed one.
    pub fn install(&mut self, name: &str, kind: Kind) {
        if let Some(model) = self.find_mut(name) {
            model.kind = kind;
            return;
        }
        self.list.push(Model {
            name: with_tag(name),
            kind,
            modified_at: SystemTime::now(),
            loaded_until: None,
            architecture: None,
        });
    }

    /// Sets a model's architecture as `/api/show` reports it; no-op if unknown.
    pub fn set_architecture(&mut self, name: &str, architecture: &str) {
        if let Some(model) = self.find_mut(name) {
            model.architecture = Some(architecture.to_owned());
        }
    }

    /// Removes a model; false when it was not installed.
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.list.len();
        let wanted = canonical(name);
        self.list.retain(|model| canonical(&model.name) != wanted);
        self.list.len() != before
    }

    /// The installed model a request's model string names.
    pub fn find(&self, name: &str) -> Option<&Model> {
        let wanted = canonical(name);
        self.list
            .iter()
            .find(|model| canonical(&model.name) == wanted)
    }

    fn find_mut(&mut self, name: &str) -> Option<&mut Model> {
        let wanted = canonical(name);
        self.list
            .iter_mut()
            .find(|model| canonical(&model.name) == wanted)
    }

    /// Marks a model loaded (or unloaded) as a request's `keep_alive` asks; no-op if unknown.
    pub fn touch(&mut self, name: &str, keep_alive: Option<KeepAlive>) {
        let now = SystemTime::now();
        if let Some(model) = self.find_mut(name) {
            model.loaded_until = match keep_alive {
                None => Some(now + DEFAULT_KEEP_ALIVE),
                Some(KeepAlive::For(duration)) => Some(now + duration),
                Some(KeepAlive::Forever) => Some(now + FOREVER),
                Some(KeepAlive::Unload) => None,
            };
        }
    }

    /// `GET /api/tags`.
    pub fn tags(&self) -> Value {
        let models: Vec<Value> = self.list.iter().map(entry).collect();
        json!({ "models": models })
    }

    /// `GET /api/ps`: loaded models, the one with the most time left first.
    pub fn ps(&self) -> Value {
        let now = SystemTime::now();
        let mut loaded: Vec<(&Model, SystemTime)> = self
            .list
            .iter()
            .filter_map(|model| {
                model
                    .loaded_until
                    .filter(|until| *until > now)
                    .map(|until| (model, until))
            })
            .collect();
        loaded.sort_by_key(|(_, until)| std::cmp::Reverse(*until));
        let models: Vec<Value> = loaded
            .into_iter()
            .map(|(model, until)| ps_entry(model, size(model), until))
            .collect();
        json!({ "models": models })
    }

    /// `GET /api/ps` in VRAM mode: the rows the VRAM lists, in its order, with their sizes;
    /// models no longer installed are left out.
    pub fn ps_of(&self, rows: &[Listed]) -> Value {
        let models: Vec<Value> = rows
            .iter()
            .filter_map(|row| {
                let model = self.find(&row.name)?;
                Some(ps_entry(model, row.size, row.expires_at))
            })
            .collect();
        json!({ "models": models })
    }

    /// `GET /v1/models`: `data` is null, not `[]`, when nothing is installed.
    pub fn openai_list(&self) -> Value {
        let data: Vec<Value> = self
            .list
            .iter()
            .map(|model| openai_entry(&model.name, model))
            .collect();
        json!({ "object": "list", "data": if data.is_empty() { Value::Null } else { Value::from(data) } })
    }
}

/// The entry of `/v1/models/{id}` and of `/v1/models`.
pub(crate) fn openai_entry(id: &str, model: &Model) -> Value {
    let owned_by = model
        .name
        .rsplit_once('/')
        .map_or("library", |(namespace, _)| {
            namespace.rsplit('/').next().unwrap_or(namespace)
        });
    json!({ "id": id, "object": "model", "created": unix_seconds(model.modified_at), "owned_by": owned_by })
}

/// `POST /api/show` for an installed model.
pub(crate) fn show(model: &Model, verbose: bool) -> Value {
    let (architecture, capabilities) = match model.kind {
        Kind::Chat => ("llama", json!(["completion", "tools"])),
        Kind::Embedding => ("bert", json!(["embedding"])),
    };
    let architecture = model.architecture.as_deref().unwrap_or(architecture);
    let mut shown = json!({
        "license": "fake license",
        "modelfile": format!("# Modelfile generated by \"ollama show\"\nFROM {}\n", model.name),
        "parameters": "stop                           \"<|eot_id|>\"",
        "template": "{{ .Prompt }}",
        "details": details(model),
        "model_info": {
            "general.architecture": architecture,
            "general.parameter_count": size(model) * 2,
            format!("{architecture}.context_length"): CONTEXT_LENGTH,
            format!("{architecture}.embedding_length"): 4096,
        },
        "capabilities": capabilities,
        "modified_at": rfc3339(model.modified_at),
    });
    if verbose && let Some(object) = shown.as_object_mut() {
        object.insert("tensors".to_owned(), json!([]));
    }
    shown
}

/// Appends `:latest` when the last path segment carries no tag.
pub(crate) fn with_tag(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') {
        name.to_owned()
    } else {
        format!("{name}:latest")
    }
}

/// The form two names are compared in: tagged, lower case, default host and namespace dropped.
pub(crate) fn canonical(name: &str) -> String {
    let lower = with_tag(name).to_lowercase();
    let short = lower.strip_prefix("registry.ollama.ai/").unwrap_or(&lower);
    short.strip_prefix("library/").unwrap_or(short).to_owned()
}

/// A 64-hex digest derived from the name (no `sha256:` prefix, as `/api/tags` prints it).
pub(crate) fn digest(name: &str) -> String {
    let mut state = hash64(&canonical(name));
    let mut hex = String::with_capacity(64);
    for _ in 0..4 {
        state = splitmix(state);
        hex.push_str(&format!("{state:016x}"));
    }
    hex
}

fn ps_entry(model: &Model, size: u64, until: SystemTime) -> Value {
    json!({
        "name": model.name,
        "model": model.name,
        "size": size,
        "digest": digest(&model.name),
        "details": details(model),
        "expires_at": rfc3339(until),
        "size_vram": size,
        "context_length": CONTEXT_LENGTH,
    })
}

fn entry(model: &Model) -> Value {
    json!({
        "name": model.name,
        "model": model.name,
        "modified_at": rfc3339(model.modified_at),
        "size": size(model),
        "digest": digest(&model.name),
        "details": details(model),
    })
}

fn details(model: &Model) -> Value {
    let (family, parameter_size, quantization) = match model.kind {
        Kind::Chat => ("llama", "3.2B", "Q4_K_M"),
        Kind::Embedding => ("bert", "23M", "F16"),
    };
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": parameter_size,
        "quantization_level": quantization,
    })
}

fn size(model: &Model) -> u64 {
    let base = match model.kind {
        Kind::Chat => 2_000_000_000,
        Kind::Embedding => 45_000_000,
    };
    base + hash64(&model.name) % 100_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_ignores_case_and_latest() {
        let mut models = Models::default();
        models.install("Llama3.2", Kind::Chat);
        models.install("all-minilm:l6", Kind::Embedding);
        assert!(models.find("llama3.2").is_some());
        assert!(models.find("LLAMA3.2:latest").is_some());
        assert!(models.find("library/llama3.2").is_some());
        assert!(models.find("llama3.2:8b").is_none());
        assert!(models.find("all-minilm").is_none());
        assert_eq!(
            models.find("all-minilm:L6").map(|m| m.kind),
            Some(Kind::Embedding)
        );
        assert_eq!(with_tag("ns/model"), "ns/model:latest");
        assert_eq!(with_tag("host:5000/model"), "host:5000/model:latest");
    }

    #[test]
    fn ps_lists_only_loaded_models() {
        let mut models = Models::default();
        models.install("a", Kind::Chat);
        models.install("b", Kind::Chat);
        models.touch("b", Some(KeepAlive::Forever));
        models.touch("a", None);
        let ps = models.ps();
        assert_eq!(ps["models"][0]["name"], "b:latest");
        assert_eq!(ps["models"][1]["name"], "a:latest");
        models.touch("b", Some(KeepAlive::Unload));
        assert_eq!(models.ps()["models"].as_array().map(Vec::len), Some(1));
        assert_eq!(Models::default().openai_list()["data"], Value::Null);
        assert_eq!(digest("a").len(), 64);
    }
}
