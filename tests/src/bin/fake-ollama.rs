//! `fake-ollama`: the fake Ollama of `oqp_tests::fake` as a process, for the benchmark and for
//! CI's real-client step. It prints the bound address (`127.0.0.1:PORT`) on the first line of
//! stdout, then serves until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use oqp_tests::fake::FakeOllama;

/// A fake Ollama server for tests and benchmarks.
#[derive(Debug, Parser)]
#[command(name = "fake-ollama", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Install a chat-capable model (repeatable).
    #[arg(long = "model", value_name = "NAME")]
    models: Vec<String>,
    /// Install an embedding-only model (repeatable).
    #[arg(long = "embedding-model", value_name = "NAME")]
    embedding_models: Vec<String>,
    /// List a model as loaded in /api/ps (repeatable; installs it if needed).
    #[arg(long = "loaded", value_name = "NAME")]
    loaded: Vec<String>,
    /// Parallel slots, like OLLAMA_NUM_PARALLEL.
    #[arg(long, default_value_t = 1)]
    slots: usize,
    /// Requests waiting for a slot beyond this get the busy 503 (default unlimited).
    #[arg(long)]
    max_queue: Option<usize>,
    /// Delay between streamed lines, in milliseconds.
    #[arg(long, default_value_t = 0)]
    token_interval_ms: u64,
    /// Delay before the first streamed line, in milliseconds.
    #[arg(long, default_value_t = 0)]
    first_token_delay_ms: u64,
    /// Service time of non-streamed inference and embeddings, in milliseconds.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Content chunks per generation.
    #[arg(long, default_value_t = 5)]
    tokens: usize,
    /// Answer a bare 403 to requests whose Host is not local.
    #[arg(long)]
    host_check: bool,
    /// Keep only the latest N requests in memory.
    #[arg(long, default_value_t = 1024)]
    record_limit: usize,
    /// Act as ollama.com and accept this Bearer key (repeatable).
    #[arg(long = "cloud-key", value_name = "KEY")]
    cloud_keys: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut builder = FakeOllama::builder()
        .bind(args.listen)
        .slots(args.slots)
        .token_interval(Duration::from_millis(args.token_interval_ms))
        .first_token_delay(Duration::from_millis(args.first_token_delay_ms))
        .latency(Duration::from_millis(args.latency_ms))
        .tokens(args.tokens)
        .host_check(args.host_check)
        .record_limit(args.record_limit);
    for name in &args.models {
        builder = builder.model(name);
    }
    for name in &args.embedding_models {
        builder = builder.embedding_model(name);
    }
    for name in &args.loaded {
        builder = builder.loaded(name);
    }
    if let Some(max_queue) = args.max_queue {
        builder = builder.max_queue(max_queue);
    }
    if !args.cloud_keys.is_empty() {
        let keys: Vec<&str> = args.cloud_keys.iter().map(String::as_str).collect();
        builder = builder.cloud(&keys);
    }
    let fake = builder
        .try_spawn()
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", fake.addr())?;
    stdout.flush()?;
    drop(stdout);

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    fake.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        super::Args::command().debug_assert();
    }
}
