//! `tessera bench api`: load on a running node's HTTP API, with JSON out.
//!
//! 1. References: each prompt once, alone, greedy (this also places the
//!    model if the node auto-places).
//! 2. Overhead: requests one at a time; the API's added latency is the time
//!    to first token seen through HTTP minus the engine's own (the runner
//!    reports it in the answer's `tessera` figures).
//! 3. Load: `--clients` streaming clients for `--seconds`, each request's
//!    text checked against its prompt's reference (nothing lost or mixed
//!    up). A 429 is counted and retried after its Retry-After.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use super::stats;

#[derive(Debug, Args)]
pub struct ApiBenchArgs {
    /// The node's API.
    #[arg(long, default_value = "http://127.0.0.1:52415")]
    pub url: String,
    #[arg(long, default_value = "smollm2-135m-instruct-q4_1")]
    pub model: String,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// How long the load lasts.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Distinct prompts, spread over the clients.
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Requests one at a time for the overhead figure.
    #[arg(long, default_value_t = 30)]
    pub overhead_samples: usize,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    clients: usize,
    seconds: f64,
    requests: usize,
    requests_per_second: f64,
    ttft_ms_p50: f64,
    ttft_ms_p99: f64,
    /// Answers whose text differed from their prompt's reference.
    mismatched: usize,
    /// 429 answers (retried).
    rejected_429: usize,
    /// Any other failure.
    errors: usize,
    first_errors: Vec<String>,
    overhead: Overhead,
}

#[derive(Serialize)]
struct Overhead {
    samples: usize,
    http_ttft_ms_median: f64,
    engine_ttft_ms_median: f64,
    /// Median of (HTTP time to first token − engine time to first token).
    api_added_ms_median: f64,
}

/// One streamed answer.
struct Streamed {
    text: String,
    ttft: Duration,
    engine_ttft_ms: f64,
}

enum Outcome {
    Done(Streamed),
    Busy(Duration),
    Failed(String),
}

fn prompt(i: usize) -> String {
    const TOPICS: [&str; 8] = [
        "the sea",
        "a mountain",
        "bread",
        "the moon",
        "a city",
        "rain",
        "music",
        "a garden",
    ];
    format!(
        "Write one sentence about {} (request type {i}).",
        TOPICS[i % TOPICS.len()]
    )
}

/// A percentile of sorted milliseconds, as reported (to the microsecond).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    stats::round_to(stats::percentile(sorted, q), 3)
}

async fn stream_once(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> Outcome {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let response = match client
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(format!("request: {e}")),
    };
    let status = response.status();
    if status.as_u16() == 429 {
        let wait = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(1.0);
        return Outcome::Busy(Duration::from_secs_f64(wait));
    }
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Outcome::Failed(format!("{status}: {text}"));
    }
    let mut bytes = response.bytes_stream();
    let mut buffer = String::new();
    let mut text = String::new();
    let mut ttft = None;
    let mut engine_ttft_ms = 0.0;
    let mut done = false;
    while let Some(piece) = bytes.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => return Outcome::Failed(format!("stream: {e}")),
        };
        buffer.push_str(&String::from_utf8_lossy(&piece));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                    return Outcome::Failed(format!("not JSON: {data}"));
                };
                if let Some(error) = chunk.get("error") {
                    return Outcome::Failed(format!("error event: {error}"));
                }
                if let Some(content) = chunk["choices"][0]["delta"]["content"].as_str() {
                    if !content.is_empty() {
                        ttft.get_or_insert_with(|| started.elapsed());
                        text.push_str(content);
                    }
                }
                if let Some(ms) = chunk["tessera"]["time_to_first_token_ms"].as_f64() {
                    engine_ttft_ms = ms;
                }
            }
        }
    }
    if !done {
        return Outcome::Failed("the stream ended without [DONE]".into());
    }
    Outcome::Done(Streamed {
        text,
        ttft: ttft.unwrap_or_else(|| started.elapsed()),
        engine_ttft_ms,
    })
}

pub fn run(args: ApiBenchArgs) -> anyhow::Result<()> {
    if args.clients == 0 || args.prompts == 0 || args.seconds <= 0.0 {
        bail!("--clients, --prompts and --seconds must be positive");
    }
    let runtime = super::client_runtime()?;
    runtime.block_on(async move {
        let url = args.url.trim_end_matches('/').to_string();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.clients)
            .build()
            .context("HTTP client")?;
        // 1. References, alone.
        let mut references = Vec::with_capacity(args.prompts);
        for i in 0..args.prompts {
            match stream_once(&client, &url, &args.model, &prompt(i), args.max_tokens).await {
                Outcome::Done(s) => references.push(s.text),
                Outcome::Busy(_) => bail!("the node is busy before the bench began"),
                Outcome::Failed(e) => bail!("reference {i}: {e}"),
            }
        }
        // 2. Overhead, one request at a time.
        let mut http = Vec::new();
        let mut engine = Vec::new();
        let mut added = Vec::new();
        for i in 0..args.overhead_samples {
            if let Outcome::Done(s) = stream_once(
                &client,
                &url,
                &args.model,
                &prompt(i % args.prompts),
                args.max_tokens,
            )
            .await
            {
                let ms = s.ttft.as_secs_f64() * 1e3;
                http.push(ms);
                engine.push(s.engine_ttft_ms);
                added.push(ms - s.engine_ttft_ms);
            }
        }
        for v in [&mut http, &mut engine, &mut added] {
            v.sort_by(f64::total_cmp);
        }
        // 3. Load.
        let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
        let started = Instant::now();
        let mut tasks = Vec::new();
        for c in 0..args.clients {
            let client = client.clone();
            let url = url.clone();
            let model = args.model.clone();
            let references = references.clone();
            let (prompts, max_tokens) = (args.prompts, args.max_tokens);
            tasks.push(tokio::spawn(async move {
                let mut ttfts = Vec::new();
                let (mut mismatched, mut busy, mut errors) = (0, 0, Vec::new());
                let mut k = c;
                while Instant::now() < deadline {
                    let p = k % prompts;
                    match stream_once(&client, &url, &model, &prompt(p), max_tokens).await {
                        Outcome::Done(s) => {
                            ttfts.push(s.ttft.as_secs_f64() * 1e3);
                            if s.text != references[p] {
                                mismatched += 1;
                            }
                            k += 1;
                        }
                        Outcome::Busy(wait) => {
                            busy += 1;
                            tokio::time::sleep(wait).await;
                        }
                        Outcome::Failed(e) => errors.push(e),
                    }
                }
                (ttfts, mismatched, busy, errors)
            }));
        }
        let mut ttfts = Vec::new();
        let (mut mismatched, mut busy, mut errors) = (0, 0, Vec::new());
        for task in tasks {
            let (t, m, b, e) = task.await.context("a client task")?;
            ttfts.extend(t);
            mismatched += m;
            busy += b;
            errors.extend(e);
        }
        let elapsed = started.elapsed().as_secs_f64();
        ttfts.sort_by(f64::total_cmp);
        let report = Report {
            bench: "api",
            clients: args.clients,
            seconds: (elapsed * 1000.0).round() / 1000.0,
            requests: ttfts.len(),
            requests_per_second: (ttfts.len() as f64 / elapsed * 100.0).round() / 100.0,
            ttft_ms_p50: percentile(&ttfts, 0.5),
            ttft_ms_p99: percentile(&ttfts, 0.99),
            mismatched,
            rejected_429: busy,
            errors: errors.len(),
            first_errors: errors.into_iter().take(5).collect(),
            overhead: Overhead {
                samples: http.len(),
                http_ttft_ms_median: percentile(&http, 0.5),
                engine_ttft_ms_median: percentile(&engine, 0.5),
                api_added_ms_median: percentile(&added, 0.5),
            },
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(())
    })
}
