//! Headless Chromium driven over the DevTools protocol, for tests that must act in a page
//! (type into a form, click) rather than only render it (`--dump-dom`, `--screenshot`).
//!
//! [`Browser::launch`] starts `chromium --headless --remote-debugging-port=0` with a
//! throw-away profile, reads the port it chose from its log, and connects to its first page
//! over a WebSocket (a minimal client: text frames, masked as a client must, continuation
//! frames joined). [`Page::evaluate`] runs JavaScript in the page and returns its value;
//! [`Page::wait_for`] polls a JavaScript condition until it holds (a deadline, not a sleep).
//! The process dies with the [`Browser`] (`kill_on_drop`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// How long Chromium may take to start and open its debugging port.
const START: Duration = Duration::from_secs(60);

/// How long one DevTools call may take.
const CALL: Duration = Duration::from_secs(30);

/// A running headless Chromium.
#[derive(Debug)]
pub struct Browser {
    _child: Child,
    _profile: tempfile::TempDir,
    port: u16,
}

/// One page (tab) of a [`Browser`], over its DevTools WebSocket.
#[derive(Debug)]
pub struct Page {
    socket: TcpStream,
    next_id: u64,
}

/// Chromium on `PATH`, if it is installed.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

impl Browser {
    /// Starts `binary` headless on a blank page.
    pub async fn launch(binary: &Path) -> anyhow::Result<Self> {
        let profile = tempfile::tempdir()?;
        let mut child = Command::new(binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--password-store=basic",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let stderr = child.stderr.take().context("no stderr")?;
        let (found, port) = tokio::sync::oneshot::channel();
        // Read the log until the port is announced, then keep draining it so that a full
        // pipe never stalls the browser.
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            let mut found = Some(found);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.split("DevTools listening on ws://").nth(1)
                    && let Some(port) = rest
                        .split_once('/')
                        .and_then(|(address, _)| address.rsplit_once(':'))
                        .and_then(|(_, port)| port.parse::<u16>().ok())
                    && let Some(found) = found.take()
                {
                    let _ = found.send(port);
                }
            }
        });
        let port = tokio::time::timeout(START, port)
            .await
            .context("chromium did not open its debugging port in time")?
            .context("chromium exited before opening its debugging port")?;
        Ok(Self {
            _child: child,
            _profile: profile,
            port,
        })
    }

    /// The first page, connected.
    pub async fn page(&self) -> anyhow::Result<Page> {
        let list = http_get(self.port, "/json/list").await?;
        let targets: Vec<Value> = serde_json::from_str(&list)?;
        let url = targets
            .iter()
            .find(|target| target["type"] == "page")
            .and_then(|target| target["webSocketDebuggerUrl"].as_str())
            .context("no page target")?;
        let path = url
            .strip_prefix("ws://")
            .and_then(|rest| rest.find('/').map(|at| &rest[at..]))
            .context("an unexpected debugger URL")?;
        let mut socket = TcpStream::connect(("127.0.0.1", self.port)).await?;
        let key = base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 16]>());
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nUpgrade: websocket\r\n\
             Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n",
            self.port
        );
        socket.write_all(request.as_bytes()).await?;
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            socket.read_exact(&mut byte).await?;
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head);
        if !head.starts_with("HTTP/1.1 101") {
            bail!("the WebSocket upgrade was refused: {head}");
        }
        Ok(Page { socket, next_id: 1 })
    }
}

impl Page {
    /// Calls a DevTools method and returns its result (events in between are skipped).
    pub async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        self.send(message.as_bytes()).await?;
        tokio::time::timeout(CALL, self.reply(id, method))
            .await
            .with_context(|| format!("{method}: no answer within {CALL:?}"))?
    }

    async fn reply(&mut self, id: u64, method: &str) -> anyhow::Result<Value> {
        loop {
            let reply: Value = serde_json::from_slice(&self.receive().await?)?;
            if reply["id"] != id {
                continue;
            }
            if let Some(error) = reply.get("error") {
                bail!("{method}: {error}");
            }
            return Ok(reply["result"].clone());
        }
    }

    /// Opens `url` in the page (without waiting for it to load: see [`Page::wait_for`]).
    pub async fn navigate(&mut self, url: &str) -> anyhow::Result<()> {
        self.call("Page.navigate", json!({ "url": url })).await?;
        Ok(())
    }

    /// The value of the JavaScript `expression` in the page (promises awaited).
    pub async fn evaluate(&mut self, expression: &str) -> anyhow::Result<Value> {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            )
            .await?;
        if let Some(exception) = result.get("exceptionDetails") {
            bail!("{expression}: {exception}");
        }
        Ok(result["result"]["value"].clone())
    }

    /// Waits until the JavaScript `condition` is true in the page, for at most `limit`.
    /// Evaluation errors (the page between two documents) count as "not yet".
    pub async fn wait_for(&mut self, condition: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(Value::Bool(true)) = self.evaluate(condition).await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let url = self.evaluate("location.href").await.unwrap_or_default();
                let text = self
                    .evaluate("document.body ? document.body.innerText.slice(0, 400) : ''")
                    .await
                    .unwrap_or_default();
                bail!("`{condition}` did not hold within {limit:?} (page {url}: {text})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn send(&mut self, payload: &[u8]) -> anyhow::Result<()> {
        let mut frame = vec![0x81u8];
        let length = payload.len();
        if length < 126 {
            frame.push(0x80 | length as u8);
        } else if let Ok(length) = u16::try_from(length) {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&length.to_be_bytes());
        } else {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(length as u64).to_be_bytes());
        }
        let mask: [u8; 4] = rand::random();
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.socket.write_all(&frame).await?;
        Ok(())
    }

    /// The next whole text message.
    async fn receive(&mut self) -> anyhow::Result<Vec<u8>> {
        let mut message = Vec::new();
        loop {
            let mut head = [0u8; 2];
            self.socket.read_exact(&mut head).await?;
            let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
            let mut length = u64::from(head[1] & 0x7f);
            if length == 126 {
                let mut bytes = [0u8; 2];
                self.socket.read_exact(&mut bytes).await?;
                length = u64::from(u16::from_be_bytes(bytes));
            } else if length == 127 {
                let mut bytes = [0u8; 8];
                self.socket.read_exact(&mut bytes).await?;
                length = u64::from_be_bytes(bytes);
            }
            let mut payload = vec![0u8; usize::try_from(length)?];
            self.socket.read_exact(&mut payload).await?;
            match opcode {
                0x8 => bail!("the browser closed the DevTools connection"),
                // Ping and pong: nothing the protocol's messages need.
                0x9 | 0xA => continue,
                _ => message.extend_from_slice(&payload),
            }
            if fin {
                return Ok(message);
            }
        }
    }
}

/// One plain GET to the browser's debugging port. Its server keeps the connection open
/// whatever the request says: the body is read by its `Content-Length`.
async fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    let mut socket = TcpStream::connect(("127.0.0.1", port)).await?;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await?;
    let mut reader = BufReader::new(socket);
    let mut length = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            bail!("the debugging port closed before its body");
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = Some(value.trim().parse::<usize>()?);
        }
    }
    let mut body = vec![0u8; length.context("no Content-Length")?];
    reader.read_exact(&mut body).await?;
    Ok(String::from_utf8(body)?)
}
