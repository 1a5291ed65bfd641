//! A real engine for the end-to-end tests: llama.cpp's `llama-server`, built
//! by `scripts/setup.sh` together with two small random-weight models
//! (`scripts/make-test-model.py`): `tiny.gguf` (chat) and `tiny-embed.gguf`
//! (served with `--embedding --pooling mean`).
//!
//! [`Engine::builder`] finds the binary and the models (the folder named by
//! `OQP_LLAMA_SERVER_DIR`, else setup's cache folder), starts `llama-server`
//! on a port of its own choosing on loopback (`--port 0`, unless given one; the
//! port is read from its log), and waits until `/health` answers 200 (polled: the model
//! loads in its own time). The process dies with the [`Engine`]
//! (`kill_on_drop`). [`installed`] decides whether a test runs: without the
//! binary a test is skipped with a printed reason, except in CI, where it
//! fails (the same rule as for chromium and promtool).
//!
//! The models' weights are random: a test may look at statuses, shapes,
//! counts, timings and slots, never at the text.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

/// The llama.cpp version `scripts/setup.sh` builds (the name of its cache folder).
pub const VERSION: &str = "11434.0.0";

/// How long an engine may take to listen and load its model.
pub const START: Duration = Duration::from_secs(60);

/// How many of the engine's last log lines an error message carries.
const LOG_TAIL: usize = 40;

/// Which of the test models an engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// `tiny.gguf`: a llama of dim 384 and 6 layers, for chat and completions.
    Chat,
    /// `tiny-embed.gguf`: a smaller llama, served with `--embedding --pooling mean`.
    Embed,
}

impl Model {
    fn file(self) -> &'static str {
        match self {
            Self::Chat => "tiny.gguf",
            Self::Embed => "tiny-embed.gguf",
        }
    }
}

/// A running `llama-server`.
#[derive(Debug)]
pub struct Engine {
    child: Child,
    port: u16,
    log: Arc<Mutex<VecDeque<String>>>,
}

/// What an [`Engine`] is started with.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    dir: PathBuf,
    model: Model,
    alias: Option<String>,
    port: u16,
    args: Vec<String>,
}

/// The folder that holds `llama-server` and the models: `OQP_LLAMA_SERVER_DIR`,
/// else `${OQP_CACHE_DIR:-$HOME/.cache/oqp}/llama-server-<VERSION>`.
pub fn dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("OQP_LLAMA_SERVER_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("OQP_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            Path::new(&home).join(".cache").join("oqp")
        });
    cache.join(format!("llama-server-{VERSION}"))
}

/// Whether `llama-server` and both models are installed. When they are not,
/// prints why (the test is then skipped), or panics when `CI=true`.
pub fn installed() -> bool {
    let dir = dir();
    let missing: Vec<PathBuf> = ["llama-server", Model::Chat.file(), Model::Embed.file()]
        .into_iter()
        .map(|name| dir.join(name))
        .filter(|path| !path.is_file())
        .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "llama-server is required in CI (scripts/setup.sh builds it); missing: {missing:?}"
    );
    eprintln!("SKIPPED: llama-server is not installed ({missing:?}); run scripts/setup.sh");
    false
}

/// The models' version from which they have fill-in-the-middle tokens (llama-server's
/// `/infill`): `scripts/setup.sh`'s `models_version`, kept in the folder's `models-version`.
const FIM_MODELS_VERSION: u32 = 2;

/// The models' version from which a `response_format` (a JSON schema's grammar) runs on the
/// chat model: its tokenizer adds no space prefix (see `scripts/make-test-model.py`).
const GRAMMAR_MODELS_VERSION: u32 = 3;

/// Whether [`installed`], with models that have fill-in-the-middle tokens. When the models
/// are older (a cache made before them), prints why (the test is then skipped), or panics
/// when `CI=true`.
pub fn fill_in_the_middle() -> bool {
    models_from(FIM_MODELS_VERSION, "fill-in-the-middle tokens")
}

/// Whether [`installed`], with a chat model on which llama-server runs a JSON schema's
/// grammar. Older models: skipped with the reason printed, or a panic when `CI=true`.
pub fn grammars() -> bool {
    models_from(
        GRAMMAR_MODELS_VERSION,
        "grammars (a tokenizer without a space prefix)",
    )
}

/// Whether [`installed`] with models of at least `version`, which brought `what`.
fn models_from(version: u32, what: &str) -> bool {
    if !installed() {
        return false;
    }
    let found = std::fs::read_to_string(dir().join("models-version"))
        .ok()
        .and_then(|text| text.trim().parse::<u32>().ok())
        .unwrap_or(1);
    if found >= version {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "the test models predate {what} (models-version {found}); scripts/setup.sh makes them \
         again"
    );
    eprintln!(
        "SKIPPED: the test models predate {what} (models-version {found}); run scripts/setup.sh"
    );
    false
}

impl Engine {
    /// An engine serving `model` from the installed folder ([`dir`]).
    pub fn builder(model: Model) -> EngineBuilder {
        EngineBuilder {
            dir: dir(),
            model,
            alias: None,
            port: 0,
            args: Vec::new(),
        }
    }

    /// The port it listens on (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its last log lines (for a failing test's message).
    pub fn log_tail(&self) -> String {
        let log = self.log.lock().unwrap();
        log.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Stops the process and waits for it to exit.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

impl EngineBuilder {
    /// The model name it answers with and lists (`--alias`).
    pub fn alias(mut self, alias: &str) -> Self {
        self.alias = Some(alias.to_owned());
        self
    }

    /// Listens on `port` (default 0: a port of its own choosing), e.g. the port another
    /// server just left, to play a host restarted as another kind of server.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Slots (`-np`).
    pub fn parallel(self, slots: u32) -> Self {
        self.arg("-np").arg(&slots.to_string())
    }

    /// Total context, shared by the slots (`-c`).
    pub fn context(self, tokens: u32) -> Self {
        self.arg("-c").arg(&tokens.to_string())
    }

    /// One more command-line argument (e.g. `--metrics`, `--no-slots`).
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }

    /// Starts it and waits until it listens and `/health` answers 200.
    pub async fn start(self) -> Engine {
        self.try_start().await.expect("start llama-server")
    }

    /// As [`start`](Self::start), with the reason on failure.
    pub async fn try_start(self) -> anyhow::Result<Engine> {
        let binary = self.dir.join("llama-server");
        let model = self.dir.join(self.model.file());
        let mut command = Command::new(&binary);
        command
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            // Two shared cores run every test: one thread each keeps several engines fair.
            .args(["-t", "1", "-tb", "1"])
            .arg("--no-webui");
        if let Some(alias) = &self.alias {
            command.args(["--alias", alias]);
        }
        if self.model == Model::Embed {
            command.args(["--embedding", "--pooling", "mean"]);
        }
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;

        // Both streams are drained for the process's whole life (a full pipe
        // would stall it); the first "listening on" line gives the port.
        let log = Arc::new(Mutex::new(VecDeque::new()));
        let (port_tx, port_rx) = oneshot::channel();
        let port_tx = Arc::new(Mutex::new(Some(port_tx)));
        if let Some(stdout) = child.stdout.take() {
            spawn_reader(stdout, log.clone(), port_tx.clone());
        }
        if let Some(stderr) = child.stderr.take() {
            spawn_reader(stderr, log.clone(), port_tx);
        }
        let mut engine = Engine {
            child,
            port: 0,
            log,
        };
        engine.port = match tokio::time::timeout(START, port_rx).await {
            Ok(Ok(port)) => port,
            _ => bail!(
                "llama-server did not report its port; its log:\n{}",
                engine.log_tail()
            ),
        };
        engine.wait_healthy().await?;
        Ok(engine)
    }
}

impl Engine {
    /// Polls `/health` until it answers 200 (503 while the model loads).
    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let uri: http::Uri = format!("{}/health", self.url()).parse()?;
        let deadline = Instant::now() + START;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "llama-server exited ({status}) while loading; its log:\n{}",
                    self.log_tail()
                );
            }
            if let Ok(response) = client.get(uri.clone()).await {
                let status = response.status();
                let _ = response.into_body().collect().await;
                if status == http::StatusCode::OK {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "llama-server was not healthy within {START:?}; its log:\n{}",
                    self.log_tail()
                );
            }
            // Loading has no event to wait on from outside the process.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

type PortSender = Arc<Mutex<Option<oneshot::Sender<u16>>>>;

fn spawn_reader(
    stream: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    log: Arc<Mutex<VecDeque<String>>>,
    port_tx: PortSender,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(port) = listening_port(&line)
                && let Some(tx) = port_tx.lock().unwrap().take()
            {
                let _ = tx.send(port);
            }
            let mut log = log.lock().unwrap();
            if log.len() == LOG_TAIL {
                log.pop_front();
            }
            log.push_back(line);
        }
    });
}

/// `count` made-up words (`w` and up to five digits, about six tokens each for the test
/// models' vocabulary), the same for the same `seed` and different across seeds: a prompt
/// of a known rough length that shares no prefix with another seed's.
pub fn random_words(seed: u64, count: usize) -> String {
    // xorshift64*: enough to make words, no dependency.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut words = Vec::with_capacity(count);
    for _ in 0..count {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let value = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        words.push(format!("w{}", (value >> 33) % 100_000));
    }
    words.join(" ")
}

/// The port in llama-server's `listening on http://127.0.0.1:<port>` line.
fn listening_port(line: &str) -> Option<u16> {
    let (_, rest) = line.split_once("listening on http://")?;
    let (_, port) = rest.trim().rsplit_once(':')?;
    port.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_words_are_repeatable_and_differ_by_seed() {
        assert_eq!(random_words(7, 50), random_words(7, 50));
        assert_ne!(random_words(7, 50), random_words(8, 50));
        assert_eq!(random_words(7, 50).split(' ').count(), 50);
    }

    #[test]
    fn the_port_is_read_from_the_listening_line() {
        assert_eq!(
            listening_port("srv  main: listening on http://127.0.0.1:41234"),
            Some(41234)
        );
        assert_eq!(listening_port("srv  load_model: loading model"), None);
    }
}
