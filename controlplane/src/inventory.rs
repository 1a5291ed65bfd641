//! What polling learned about each host: the plain data that the poller
//! writes, the hub keeps and the snapshot compiler reads. A leaf: it imports
//! nothing of the crate.

use std::time::SystemTime;

/// What polling learned about one host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Whether the last poll succeeded.
    pub healthy: bool,
    /// Installed model names (/api/tags).
    pub installed: Vec<String>,
    /// Loaded model names (/api/ps, loading ones included).
    pub loaded: Vec<String>,
    /// Installed models with their size on disk (/api/tags `size`), by name.
    pub sizes: Vec<(String, u64)>,
    /// Loaded models with their bytes in VRAM (/api/ps `size_vram`, else `size`), by name.
    pub resident: Vec<(String, u64)>,
    /// When it was last polled.
    pub last_checked: Option<SystemTime>,
    /// Installed models whose runner Ollama forces to one slot (from `/api/show`), by
    /// normalised name, with the reason.
    pub forced: Vec<(String, String)>,
    /// What `/api/show` said of each installed model, at the digest it was asked for.
    pub shown: Vec<Shown>,
    /// What answered at the last successful poll and what it said of itself (kind, slots).
    pub learned: Learned,
    /// Why the last poll failed (the host is then down); `None` after a successful one.
    pub error: Option<String>,
}

/// One row of a model list: its name and bytes (`/api/tags`: `size` on disk;
/// `/api/ps`: `size_vram`, else `size`).
pub type Listed = (String, u64);

/// What sits behind a host's URL, as a poll found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    /// An Ollama server (`/api/version` answered).
    Ollama,
    /// llama.cpp's llama-server (`/props` answered with `total_slots`).
    LlamaServer,
    /// Another OpenAI-compatible engine (`/v1/models` lists models).
    Openai,
}

impl Detected {
    /// How status and logs name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ollama => "ollama",
            Self::LlamaServer => "llama-server",
            Self::Openai => "openai",
        }
    }

    /// Whether it is polled and routed as an OpenAI-style engine.
    pub fn is_openai(self) -> bool {
        matches!(self, Self::LlamaServer | Self::Openai)
    }
}

/// What a poll learned of an engine besides its models.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Learned {
    /// What answered; `None` when nothing did.
    pub detected: Option<Detected>,
    /// Slots from llama-server's `/props` (`total_slots`), when believable.
    pub slots: Option<u32>,
    /// Each slot's context in tokens (`/props` `default_generation_settings.n_ctx`).
    pub slot_context: Option<u32>,
    /// What was wrong with what the engine said, for status and the log.
    pub problem: Option<String>,
}

/// What one installed model's `/api/show` said, for the digest it was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    /// The model as `/api/tags` names it.
    pub model: String,
    /// Its digest then: asked again only when it changes.
    pub digest: String,
    /// Why Ollama runs it with one slot, if it does.
    pub forced: Option<String>,
}
