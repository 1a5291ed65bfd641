//! `fake-ollama`: the fake Ollama of `oqp_tests::fake` as a process, for the benchmark and for
//! CI's real-client step. It prints the bound address (`127.0.0.1:PORT`) on the first line of
//! stdout, then serves until SIGINT or SIGTERM. `--vram` turns on the faithful VRAM mode
//! (capacity, model sizes, load and unload times; see `FakeBuilder::vram`).

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use oqp_tests::fake::{FakeBuilder, FakeOllama};

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
    /// An OpenAI stream's tokens end in `@<Unix nanoseconds>` of the moment each is written.
    #[arg(long)]
    stamp_tokens: bool,
    /// Answer a bare 403 to requests whose Host is not local.
    #[arg(long)]
    host_check: bool,
    /// Run each model as its own runner with this many slots (OLLAMA_NUM_PARALLEL; one for
    /// embedding models); `--slots` then bounds the whole box.
    #[arg(long)]
    runners: Option<usize>,
    /// With runners: model each slot's prompt cache, reading uncached prompt tokens at this
    /// many milliseconds per 1,000.
    #[arg(long)]
    prompt_cache_ms_per_1k: Option<f64>,
    /// Keep only the latest N requests in memory.
    #[arg(long, default_value_t = 1024)]
    record_limit: usize,
    /// Act as ollama.com and accept this Bearer key (repeatable).
    #[arg(long = "cloud-key", value_name = "KEY")]
    cloud_keys: Vec<String>,
    /// Turn on the VRAM mode with this capacity (`24GiB`, `8GB`, or bytes).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    vram: Option<u64>,
    /// VRAM mode: the size of one model (repeatable).
    #[arg(long = "model-size", value_name = "NAME=SIZE", value_parser = parse_model_size)]
    model_sizes: Vec<(String, u64)>,
    /// VRAM mode: the size of models without their own (default 4GiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    default_model_size: Option<u64>,
    /// VRAM mode: at most this many models loaded at once (OLLAMA_MAX_LOADED_MODELS).
    #[arg(long)]
    max_loaded_models: Option<usize>,
    /// VRAM mode: how long loading a model takes, in milliseconds.
    #[arg(long, default_value_t = 0)]
    load_time_ms: u64,
    /// VRAM mode: how long loading one model takes, in milliseconds (repeatable).
    #[arg(long = "model-load-time-ms", value_name = "NAME=MS", value_parser = parse_model_ms)]
    model_load_times: Vec<(String, u64)>,
    /// VRAM mode: how long unloading a model takes, in milliseconds.
    #[arg(long, default_value_t = 0)]
    unload_time_ms: u64,
    /// VRAM mode: how long unloading one model takes, in milliseconds (repeatable).
    #[arg(long = "model-unload-time-ms", value_name = "NAME=MS", value_parser = parse_model_ms)]
    model_unload_times: Vec<(String, u64)>,
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
        .stamp_tokens(args.stamp_tokens)
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
    if let Some(ms) = args.prompt_cache_ms_per_1k {
        builder = builder.prompt_cache(ms);
    }
    if let Some(num_parallel) = args.runners {
        builder = builder.runners(num_parallel);
    }
    if let Some(max_queue) = args.max_queue {
        builder = builder.max_queue(max_queue);
    }
    if !args.cloud_keys.is_empty() {
        let keys: Vec<&str> = args.cloud_keys.iter().map(String::as_str).collect();
        builder = builder.cloud(&keys);
    }
    builder = vram(builder, &args);
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

// The VRAM flags; none of them matters without `--vram`.
fn vram(mut builder: FakeBuilder, args: &Args) -> FakeBuilder {
    let Some(capacity) = args.vram else {
        return builder;
    };
    builder = builder
        .vram(capacity)
        .load_time(Duration::from_millis(args.load_time_ms))
        .unload_time(Duration::from_millis(args.unload_time_ms));
    if let Some(n) = args.max_loaded_models {
        builder = builder.max_loaded_models(n);
    }
    if let Some(size) = args.default_model_size {
        builder = builder.default_model_size(size);
    }
    for (name, size) in &args.model_sizes {
        builder = builder.model_size(name, *size);
    }
    for (name, ms) in &args.model_load_times {
        builder = builder.model_load_time(name, Duration::from_millis(*ms));
    }
    for (name, ms) in &args.model_unload_times {
        builder = builder.model_unload_time(name, Duration::from_millis(*ms));
    }
    builder
}

/// A size in bytes: a number with an optional unit, decimal (`KB`, `MB`, `GB`, `TB`) or binary
/// (`KiB`, `MiB`, `GiB`, `TiB`), case ignored; a fraction is allowed with a unit (`1.5GiB`).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = (&text[..split], text[split..].trim());
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(format!("unknown unit {unit:?} in {text:?}")),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 24GiB"))?;
    Ok((value * scale as f64).round() as u64)
}

fn parse_model_size(text: &str) -> Result<(String, u64), String> {
    let (name, size) = split_pair(text)?;
    Ok((name, parse_size(size)?))
}

fn parse_model_ms(text: &str) -> Result<(String, u64), String> {
    let (name, ms) = split_pair(text)?;
    let ms = ms
        .parse()
        .map_err(|_| format!("{ms:?} is not a number of milliseconds"))?;
    Ok((name, ms))
}

fn split_pair(text: &str) -> Result<(String, &str), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_owned(), value)),
        _ => Err(format!("{text:?} is not NAME=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        super::Args::command().debug_assert();
    }

    #[test]
    fn vram_flags_parse() {
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("1.5 gib"), Ok(3 << 29));
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
        let args = Args::try_parse_from([
            "fake-ollama",
            "--vram",
            "10GiB",
            "--model-size",
            "llama3=6GiB",
            "--model-load-time-ms",
            "llama3=3000",
            "--unload-time-ms",
            "50",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.vram, Some(10 << 30));
        assert_eq!(args.model_sizes, [("llama3".to_owned(), 6 << 30)]);
        assert_eq!(args.model_load_times, [("llama3".to_owned(), 3000)]);
        assert_eq!(args.unload_time_ms, 50);
        assert!(Args::try_parse_from(["fake-ollama", "--model-size", "=1"]).is_err());
    }
}
