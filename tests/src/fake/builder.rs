//! `FakeBuilder`: how a test describes the Ollama it needs (installed and loaded models, slots,
//! queue limit, timings, version, Host check, cloud mode, address, the VRAM mode) before `spawn`
//! binds it.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::FakeOllama;
use super::cloud::Cloud;
use super::gojson::KeepAlive;
use super::handle::FakeHandle;
use super::models::{Kind, Models, canonical};
use super::record::Recorder;
use super::server::{Server, bind};
use super::slots::Slots;
use super::state::{Shared, Timing};
use super::vram::{self, Vram};

/// The architectures Ollama runs with one slot whatever `OLLAMA_NUM_PARALLEL` (its
/// `server/sched.go`).
const FORCED_ARCHITECTURES: &[&str] = &[
    "mllama",
    "qwen3vl",
    "qwen35",
    "qwen3next",
    "lfm2",
    "nemotron_h",
];

/// The configuration of a fake Ollama; every setter takes and returns the builder.
#[derive(Debug, Clone)]
pub struct FakeBuilder {
    models: Vec<(String, Kind, bool)>,
    slots: usize,
    max_queue: Option<usize>,
    timing: Timing,
    version: String,
    host_check: bool,
    cloud: Option<Vec<String>>,
    bind: SocketAddr,
    embedding_dimension: usize,
    record_limit: Option<usize>,
    vram: Option<u64>,
    vram_config: vram::Config,
    runners: Option<usize>,
    prompt_cache: Option<Duration>,
    architectures: Vec<(String, String)>,
}

impl Default for FakeBuilder {
    fn default() -> Self {
        Self {
            models: Vec::new(),
            slots: 1,
            max_queue: None,
            timing: Timing {
                latency: Duration::ZERO,
                first_token_delay: Duration::ZERO,
                token_interval: Duration::ZERO,
                tokens: 5,
                stamp_tokens: false,
            },
            version: "0.32.15".to_owned(),
            host_check: false,
            cloud: None,
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            embedding_dimension: 8,
            record_limit: None,
            vram: None,
            vram_config: vram::Config::default(),
            runners: None,
            prompt_cache: None,
            architectures: Vec::new(),
        }
    }
}

impl FakeBuilder {
    /// Installs a chat- and generate-capable model (listed in `/api/tags`).
    pub fn model(mut self, name: &str) -> Self {
        self.models.push((name.to_owned(), Kind::Chat, false));
        self
    }

    /// Installs an embedding-only model: generate and chat answer 400 `"x" does not support …`.
    pub fn embedding_model(mut self, name: &str) -> Self {
        self.models.push((name.to_owned(), Kind::Embedding, false));
        self
    }

    /// Also lists the model in `/api/ps`; installs it as a chat model if it is not installed yet.
    pub fn loaded(mut self, name: &str) -> Self {
        match self
            .models
            .iter_mut()
            .find(|(installed, _, _)| canonical(installed) == canonical(name))
        {
            Some(model) => model.2 = true,
            None => self.models.push((name.to_owned(), Kind::Chat, true)),
        }
        self
    }

    /// Runs each model as its own runner with `num_parallel` slots (`OLLAMA_NUM_PARALLEL`, as
    /// Ollama 0.30 and later do): one for embedding models and for the architectures Ollama
    /// forces (qwen3vl, qwen35, qwen3next, lfm2, nemotron_h, mllama). A request beyond its
    /// runner's slots waits inside the fake, which logs its wait ([`FakeHandle::runner_log`]).
    /// `slots` then bounds the whole box (set it to the sum you want, or high).
    pub fn runners(mut self, num_parallel: usize) -> Self {
        self.runners = Some(num_parallel.max(1));
        self
    }

    /// Models llama-server's prompt cache in each runner slot (reference §5), with runners on:
    /// a slot keeps its last prompt and answer; a request takes the idle slot whose longest
    /// common prefix with its prompt, over the prompt's length, is above 0.10 (the highest),
    /// else the least recently used one; `ms_per_1k` × its uncached tokens (4 bytes a token)
    /// is added to its time to first token. `prompt_eval_count` counts every prompt token,
    /// `prompt_eval_duration` only the uncached ones' reading. An unload empties the caches.
    /// [`FakeHandle::runner_log`] shows each request's cached tokens.
    pub fn prompt_cache(mut self, ms_per_1k: f64) -> Self {
        self.prompt_cache = Some(Duration::from_secs_f64(ms_per_1k.max(0.0) / 1000.0));
        self
    }

    /// Sets an installed model's architecture (`/api/show` `model_info."general.architecture"`).
    pub fn architecture(mut self, model: &str, architecture: &str) -> Self {
        self.architectures
            .push((model.to_owned(), architecture.to_owned()));
        self
    }

    /// Parallel slots, like `OLLAMA_NUM_PARALLEL` (default 1): inference requests beyond this
    /// wait, without error, until a slot frees.
    pub fn slots(mut self, n: usize) -> Self {
        self.slots = n.max(1);
        self
    }

    /// Requests waiting for a slot beyond `n` get Ollama's 503 "server busy" (default unlimited).
    /// In VRAM mode the limit is Ollama's own: on cold requests in the pending queue, while
    /// requests for a resident model wait for a slot without limit.
    pub fn max_queue(mut self, n: usize) -> Self {
        self.max_queue = Some(n);
        self
    }

    /// Service time of non-streamed inference and embeddings, spent holding the slot.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.timing.latency = latency;
        self
    }

    /// Streamed responses: delay before the first line, spent holding the slot.
    pub fn first_token_delay(mut self, delay: Duration) -> Self {
        self.timing.first_token_delay = delay;
        self
    }

    /// Streamed responses: delay between lines.
    pub fn token_interval(mut self, interval: Duration) -> Self {
        self.timing.token_interval = interval;
        self
    }

    /// An OpenAI stream's tokens end in `@<Unix nanoseconds>`, the moment each frame is
    /// written (a proxy's per-line delay measured from the sender, through any translation).
    pub fn stamp_tokens(mut self, stamp: bool) -> Self {
        self.timing.stamp_tokens = stamp;
        self
    }

    /// Content chunks per generation (default 5).
    pub fn tokens(mut self, n: usize) -> Self {
        self.timing.tokens = n;
        self
    }

    /// The version `/api/version` reports (default "0.32.15").
    pub fn version(mut self, version: &str) -> Self {
        self.version = version.to_owned();
        self
    }

    /// Answers a bare 403 when the Host header is not local, as Ollama does on loopback.
    pub fn host_check(mut self, on: bool) -> Self {
        self.host_check = on;
        self
    }

    /// ollama.com mode: requests must present `Authorization: Bearer <one of keys>`, else 401
    /// `{"error":"unauthorized"}` (`/`, `/api/version` and `/api/tags` excepted).
    pub fn cloud(mut self, keys: &[&str]) -> Self {
        self.cloud = Some(keys.iter().map(|key| (*key).to_owned()).collect());
        self
    }

    /// The address to listen on (default `127.0.0.1:0`); lets a test restart a fake on the port
    /// of one it shut down.
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = addr;
        self
    }

    /// The length of embedding vectors (default 8).
    pub fn embedding_dimension(mut self, n: usize) -> Self {
        self.embedding_dimension = n.max(1);
        self
    }

    /// Keeps only the latest `n` requests in the log (default: all), for long runs such as the
    /// benchmark; `wait_for_requests` still counts every request.
    pub fn record_limit(mut self, n: usize) -> Self {
        self.record_limit = Some(n);
        self
    }

    /// Turns on the faithful VRAM mode with `bytes` of VRAM (off by default). Models then take
    /// room as Ollama's scheduler gives it: a request for a resident model runs at once; one for
    /// a cold model waits in ONE FIFO pending queue whose head blocks the rest; the head loads
    /// when it fits, else a victim is chosen (shortest `keep_alive`, then name, idle ones first)
    /// and unloaded once its in-flight requests finish, new requests still running on it.
    /// `keep_alive` works as in Ollama (default 5m, 0 unloads after the request, negative keeps
    /// forever; an empty prompt with 0 unloads); `/api/ps` lists loaded and loading models with
    /// their sizes; `load_duration` counts from the request's arrival. `loaded` models start
    /// resident, kept forever, if they fit.
    pub fn vram(mut self, bytes: u64) -> Self {
        self.vram = Some(bytes);
        self
    }

    /// VRAM mode: the size of one model (`/api/ps` shows it as `size` and `size_vram`).
    pub fn model_size(mut self, name: &str, bytes: u64) -> Self {
        self.vram_config.sizes.insert(canonical(name), bytes);
        self
    }

    /// VRAM mode: the size of models without their own (default 4 GiB).
    pub fn default_model_size(mut self, bytes: u64) -> Self {
        self.vram_config.default_size = bytes;
        self
    }

    /// VRAM mode: how long loading a model takes (default: no time).
    pub fn load_time(mut self, time: Duration) -> Self {
        self.vram_config.load = time;
        self
    }

    /// VRAM mode: how long loading one model takes.
    pub fn model_load_time(mut self, name: &str, time: Duration) -> Self {
        self.vram_config.loads.insert(canonical(name), time);
        self
    }

    /// VRAM mode: how long unloading a model takes (default: no time).
    pub fn unload_time(mut self, time: Duration) -> Self {
        self.vram_config.unload = time;
        self
    }

    /// VRAM mode: how long unloading one model takes.
    pub fn model_unload_time(mut self, name: &str, time: Duration) -> Self {
        self.vram_config.unloads.insert(canonical(name), time);
        self
    }

    /// VRAM mode: at most `n` models in VRAM at once, however much room is left, like
    /// `OLLAMA_MAX_LOADED_MODELS` (default: no cap).
    pub fn max_loaded_models(mut self, n: usize) -> Self {
        self.vram_config.max_loaded = Some(n.max(1));
        self
    }

    /// Binds and starts the fake. Panics if the address cannot be bound (a test helper).
    pub async fn spawn(self) -> FakeOllama {
        let addr = self.bind;
        match self.try_spawn().await {
            Ok(fake) => fake,
            Err(error) => panic!("fake Ollama cannot bind {addr}: {error}"),
        }
    }

    /// Binds and starts the fake, returning the bind error instead of panicking.
    pub async fn try_spawn(self) -> std::io::Result<FakeOllama> {
        let listener = bind(self.bind)?;
        let addr = listener.local_addr()?;
        let mut models = Models::default();
        for (name, kind, loaded) in &self.models {
            models.install(name, *kind);
            if *loaded {
                models.touch(name, Some(KeepAlive::Forever));
            }
        }
        for (model, architecture) in &self.architectures {
            models.set_architecture(model, architecture);
        }
        let forced: Vec<String> = self
            .architectures
            .iter()
            .filter(|(_, architecture)| FORCED_ARCHITECTURES.contains(&architecture.as_str()))
            .map(|(model, _)| super::models::canonical(model))
            .collect();
        let runners = self.runners.map(|num_parallel| {
            Arc::new(super::runners::Runners::new(
                num_parallel,
                forced,
                self.prompt_cache,
            ))
        });
        let vram = self.vram.map(|capacity| {
            let preloaded: Vec<String> = self
                .models
                .iter()
                .filter(|(_, _, loaded)| *loaded)
                .map(|(name, _, _)| name.clone())
                .collect();
            let config = vram::Config {
                capacity,
                max_pending: self.max_queue,
                ..self.vram_config
            };
            Vram::spawn(config, &preloaded)
        });
        let shared = Arc::new(Shared {
            version: self.version,
            host_check: self.host_check,
            embedding_dimension: self.embedding_dimension,
            cloud: self.cloud.map(Cloud::new),
            timing: Mutex::new(self.timing),
            models: Mutex::new(models),
            slots: Arc::new(Slots::new(
                self.slots,
                self.max_queue.filter(|_| vram.is_none()),
            )),
            vram,
            runners,
            recorder: Recorder::new(self.record_limit),
            failures: Mutex::new(VecDeque::new()),
            cancelled: watch::Sender::new(0),
            connections: AtomicUsize::new(0),
            shutting_down: AtomicBool::new(false),
            blobs: Mutex::default(),
            answer_headers: Mutex::default(),
        });
        let server = Server::spawn(listener, Arc::clone(&shared));
        Ok(FakeOllama {
            addr,
            handle: FakeHandle { shared },
            server,
        })
    }
}
