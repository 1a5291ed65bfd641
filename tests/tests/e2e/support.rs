//! What the end-to-end suites share: the scale (CI or soak), a closed-loop
//! load that counts every answer and keeps every failure, raw-socket helpers
//! for malformed traffic, and a `redis-server` child process.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use oqp_tests::bench::load::{Conn, Req};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Taken by every test that generates heavy load or measures timing (a
/// fairness index, a wait percentile): the suites share one test binary, so
/// without it a load test could run beside a timing test on this machine's
/// two cores. Light tests run beside anything.
/// The in-process data plane's dispatcher of a single-box stack.
pub fn dispatcher(stack: &oqp_tests::harness::Stack) -> Arc<oqp_dataplane::dispatch::Dispatcher> {
    stack.control.dataplane().unwrap().app().dispatcher.clone()
}

/// Waits (bounded) until `depth` requests wait in `dispatcher`'s queue, all tiers.
pub async fn wait_depth(dispatcher: &oqp_dataplane::dispatch::Dispatcher, depth: u32) {
    assert!(
        oqp_tests::client::eventually(Duration::from_secs(30), || dispatcher.total_depth()
            == depth)
        .await,
        "queue depth never reached {depth} (is {})",
        dispatcher.total_depth()
    );
}

pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    EXCLUSIVE.lock().await
}

/// Whether the long mode is on (`OQP_SOAK=1`).
pub fn soak() -> bool {
    std::env::var("OQP_SOAK").is_ok_and(|value| value == "1")
}

/// `ci` in CI, `soak` under `OQP_SOAK=1`.
pub fn scale<T>(ci: T, soak_value: T) -> T {
    if soak() { soak_value } else { ci }
}

/// Answers of a load, counted.
#[derive(Debug, Default)]
pub struct Tally {
    /// 2xx answers.
    pub ok: u64,
    /// Everything else: status and body, or the transport error.
    pub failures: Vec<String>,
    /// 2xx answers per value of the header the load watches.
    pub by_header: HashMap<String, u64>,
}

/// `concurrency` clients sending back to back until stopped.
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    completed: watch::Receiver<u64>,
    tasks: Vec<JoinHandle<Tally>>,
}

impl Load {
    /// Starts `concurrency` clients against `addr`; client `i`'s `n`-th
    /// request is `request(i, n)`. `watch` names a response header whose
    /// values are counted.
    pub fn start(
        addr: SocketAddr,
        concurrency: usize,
        watch_header: Option<&'static str>,
        request: impl Fn(usize, u64) -> Req + Send + Sync + 'static,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (completed_sender, completed) = watch::channel(0u64);
        let completed_sender = Arc::new(completed_sender);
        let request = Arc::new(request);
        let tasks = (0..concurrency)
            .map(|client| {
                let (stop, completed, request) =
                    (stop.clone(), completed_sender.clone(), request.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    let mut conn: Option<Conn> = None;
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let result = async {
                            let conn = match conn.as_mut() {
                                Some(conn) => conn,
                                None => conn.insert(Conn::open(addr).await?),
                            };
                            conn.send(&request(client, n)).await
                        }
                        .await;
                        n += 1;
                        match result {
                            Ok(answer) if answer.status.is_success() => {
                                tally.ok += 1;
                                if let Some(name) = watch_header {
                                    let value = answer
                                        .headers
                                        .get(name)
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or("(none)")
                                        .to_owned();
                                    *tally.by_header.entry(value).or_default() += 1;
                                }
                            }
                            Ok(answer) => tally.failures.push(format!(
                                "{}: {}",
                                answer.status,
                                String::from_utf8_lossy(&answer.body)
                            )),
                            Err(error) => {
                                conn = None;
                                tally.failures.push(format!("transport: {error:#}"));
                            }
                        }
                        completed.send_modify(|count| *count += 1);
                    }
                    tally
                })
            })
            .collect();
        Load {
            stop,
            completed,
            tasks,
        }
    }

    /// Answers (of any kind) so far.
    pub fn completed(&self) -> u64 {
        *self.completed.borrow()
    }

    /// Waits until `more` further answers have come back (30 s at most).
    pub async fn wait_for_more(&mut self, more: u64) {
        let target = self.completed() + more;
        let reached = tokio::time::timeout(
            Duration::from_secs(30),
            self.completed.wait_for(|count| *count >= target),
        )
        .await
        .is_ok_and(|result| result.is_ok());
        assert!(
            reached,
            "the load stalled at {} answers (waiting for {target})",
            self.completed()
        );
    }

    /// Stops the clients (each finishes its request in flight) and sums up.
    pub async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = Tally::default();
        for task in self.tasks {
            let tally = task.await.expect("load task");
            total.ok += tally.ok;
            total.failures.extend(tally.failures);
            for (value, count) in tally.by_header {
                *total.by_header.entry(value).or_default() += count;
            }
        }
        total
    }
}

impl Tally {
    /// Panics, listing the first failures, unless there were none.
    pub fn assert_no_failures(&self, what: &str) {
        assert!(
            self.failures.is_empty(),
            "{what}: {} of {} requests failed; first: {:#?}",
            self.failures.len(),
            self.ok + self.failures.len() as u64,
            &self.failures[..self.failures.len().min(5)]
        );
    }
}

/// A non-streamed generate.
pub fn generate(key: Option<&str>) -> Req {
    Req::post(
        "/api/generate",
        key,
        r#"{"model":"llama3","prompt":"hi","stream":false}"#,
    )
}

/// A `redis-server` on a fixed port, killed on drop.
#[derive(Debug)]
pub struct Redis {
    child: Child,
    /// Its port.
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// Starts on `port` (0: a free one) and waits until it accepts.
    pub async fn start(port: u16) -> Redis {
        let port = if port == 0 {
            oqp_tests::bench::procs::free_port().unwrap()
        } else {
            port
        };
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--port")
            .arg(port.to_string())
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/setup.sh installs it)");
        let redis = Redis {
            child,
            port,
            _dir: dir,
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        assert!(
            oqp_tests::client::eventually(Duration::from_secs(10), || {
                std::net::TcpStream::connect(addr).is_ok()
            })
            .await,
            "redis-server did not start on {port}"
        );
        redis
    }

    /// Kills it (SIGKILL) and waits for it to exit.
    pub fn kill(mut self) -> u16 {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.port
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `request` on a new connection (a write the server cuts short is
/// not an error), then reads until the status line of an answer, or until
/// the server closes. The status, or `None` when it closed without one.
pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut reader, mut writer) = stream.split();
    let write = async {
        let _ = writer.write_all(request).await;
        // Keep the write half open: a half-close would end the request.
        std::future::pending::<()>().await;
    };
    let read = async {
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        loop {
            if let Some(status) = status_of(&answer) {
                return Some(status);
            }
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => return status_of(&answer),
                Ok(n) => answer.extend_from_slice(&buffer[..n]),
            }
        }
    };
    let exchange = async {
        tokio::select! {
            status = read => status,
            () = write => unreachable!(),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .expect("the server neither answered nor closed within 10 s")
}

/// The status of an HTTP/1.1 answer whose status line has arrived.
fn status_of(answer: &[u8]) -> Option<u16> {
    let line_end = answer.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&answer[..line_end]).ok()?;
    line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}
