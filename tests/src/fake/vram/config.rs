//! The VRAM mode's configuration: capacity, model sizes, load and unload times (each per model
//! with a default), and Ollama's caps on loaded models and on the pending queue.

use std::collections::HashMap;
use std::time::Duration;

/// How the VRAM mode is configured: capacity, sizes, load and unload times.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Bytes of VRAM.
    pub capacity: u64,
    /// The size of a model without its own.
    pub default_size: u64,
    /// Sizes by canonical model name.
    pub sizes: HashMap<String, u64>,
    /// Load time of a model without its own.
    pub load: Duration,
    /// Load times by canonical model name.
    pub loads: HashMap<String, Duration>,
    /// Unload time of a model without its own.
    pub unload: Duration,
    /// Unload times by canonical model name.
    pub unloads: HashMap<String, Duration>,
    /// Cold requests beyond this many waiting are refused (`OLLAMA_MAX_QUEUE`); `None`: no cap.
    pub max_pending: Option<usize>,
    /// At most this many models in VRAM at once (`OLLAMA_MAX_LOADED_MODELS`); `None`: no cap.
    pub max_loaded: Option<usize>,
}

impl Default for Config {
    /// No room (the mode is turned on by a capacity), 4 GiB models, instant loads and unloads.
    fn default() -> Self {
        Self {
            capacity: 0,
            default_size: 4 << 30,
            sizes: HashMap::new(),
            load: Duration::ZERO,
            loads: HashMap::new(),
            unload: Duration::ZERO,
            unloads: HashMap::new(),
            max_pending: None,
            max_loaded: None,
        }
    }
}

impl Config {
    /// The size of `model` (canonical name).
    pub fn size(&self, model: &str) -> u64 {
        self.sizes.get(model).copied().unwrap_or(self.default_size)
    }

    /// How long loading `model` takes.
    pub fn load_time(&self, model: &str) -> Duration {
        self.loads.get(model).copied().unwrap_or(self.load)
    }

    /// How long unloading `model` takes.
    pub fn unload_time(&self, model: &str) -> Duration {
        self.unloads.get(model).copied().unwrap_or(self.unload)
    }
}
