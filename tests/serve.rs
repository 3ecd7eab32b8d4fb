//! `moeforge serve` as users meet it: the official `openai` Python client
//! and curl against a server on loopback, over the CPU twin.
//!
//! The reference for every generated token is `moeforge run` (the engine
//! without the server), and for text and chat prompts Hugging Face's
//! `tokenizers`/`transformers` (tests/fixtures/tokenizer, made by
//! scripts/fixtures/tokenizer.py). The Python tier needs the `openai`
//! package: scripts/test.sh installs it and sets MOEFORGE_REQUIRE_CLIENTS=1,
//! which makes its absence a failure.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The tiny model on four ranks, switching TP → EP above 8 requests in
/// flight and back below 2, with the fixture tokenizer beside its weights.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let spec = write_spec(
        dir,
        "serve.moe",
        &["models/tiny-qwen3.moe", "models/clusters.moe", "models/tiles.moe"],
        "deploy tiny-serve {\n  model = tiny-qwen3\n  cluster = cpu4\n  tiles = hopper-bf16\n  slo { ttft = 1s  tpot = 50ms }\n  workload { input = sharegpt  output = sharegpt  arrival poisson { rate = 4req/s } }\n  strategy = colocated\n  switch { t_high = 8  t_low = 2  window = 2  cooldown = 0s }\n  memory_fraction = 0.25\n}\n",
    );
    let (bundle, weights) = (dir.join("bundle"), dir.join("weights"));
    let s = spec.to_str().unwrap();
    let o = moeforge(&["init-weights", s, "--seed", "11", "-o", weights.to_str().unwrap()], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = moeforge(&["compile", s, "-o", bundle.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(root().join("tests/fixtures/tokenizer").join(f), weights.join(f)).unwrap();
    }
    (bundle, weights)
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(bundle: &Path, weights: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(["serve", bundle.to_str().unwrap(), "--weights", weights.to_str().unwrap(), "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("the server printed its address").unwrap();
            if let Some(u) = line.strip_prefix("listening on ") {
                break u.to_string();
            }
        };
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, url }
    }

    /// SIGTERM, then the exit status (the server drains first).
    fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "the server did not stop after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// curl `args` against `url`; (HTTP status, body).
fn curl(url: &str, path: &str, args: &[&str]) -> (u16, String) {
    let o = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", "-H", "content-type: application/json"])
        .args(args)
        .arg(format!("{url}{path}"))
        .output()
        .expect("curl runs");
    let out = text(&o.stdout);
    let (body, code) = out.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_string())
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// A Prometheus sample's value.
fn metric(url: &str, name: &str) -> f64 {
    let (code, body) = curl(url, "/metrics", &[]);
    assert_eq!(code, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{body}"))
        .trim()
        .parse()
        .unwrap()
}

/// The Python with the `openai` package, or `None` (a failure under
/// MOEFORGE_REQUIRE_CLIENTS=1).
fn python() -> Option<PathBuf> {
    let candidates =
        [std::env::var_os("MOEFORGE_PYTHON").map(PathBuf::from), Some(root().join(".toolchain/venv/bin/python"))];
    let found = candidates
        .into_iter()
        .flatten()
        .find(|p| Command::new(p).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success()));
    if found.is_none() {
        assert!(
            std::env::var("MOEFORGE_REQUIRE_CLIENTS").map_or(true, |v| v != "1"),
            "MOEFORGE_REQUIRE_CLIENTS=1 but no Python with `openai`: run scripts/test.sh or set MOEFORGE_PYTHON"
        );
        eprintln!("skipping the openai-client tier: no Python with `openai` (scripts/test.sh installs it)");
    }
    found
}

fn client(py: &Path, args: &[&str]) -> Value {
    let o = Command::new(py).arg(root().join("tests/clients/openai_check.py")).args(args).output().unwrap();
    assert!(o.status.success(), "openai_check.py {args:?}: {}", text(&o.stderr));
    json(text(&o.stdout).lines().last().unwrap_or_default())
}

/// `moeforge run`'s tokens for `prompts`, one vector per request.
fn run_tokens(bundle: &Path, weights: &Path, prompts: &Path, max_new: usize) -> Vec<Vec<u32>> {
    let max = max_new.to_string();
    let o = moeforge(
        &[
            "run",
            bundle.to_str().unwrap(),
            "--weights",
            weights.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new",
            &max,
            "--start",
            "tp",
        ],
        None,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("request ").and_then(|r| r.split_once(": ")))
        .map(|(_, toks)| toks.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect()
}

fn eos() -> u32 {
    let ex = json(&std::fs::read_to_string(root().join("tests/fixtures/tokenizer/expected.json")).unwrap());
    ex["eos_id"].as_u64().unwrap() as u32
}

/// What a server with the tokenizer streams for the engine's `tokens`: up
/// to the first EOS, which ends the choice with `stop`.
fn until_eos(tokens: &[u32], eos: u32) -> (&[u32], &'static str) {
    match tokens.iter().position(|&t| t == eos) {
        Some(i) => (&tokens[..i], "stop"),
        None => (tokens, "length"),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn sixty_four_openai_streams_over_a_switching_run_equal_moeforge_run() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let mut rng = Rng(2026);
    let prompts: Vec<Vec<u32>> =
        (0..64).map(|_| (0..3 + rng.below(20)).map(|_| 3 + rng.below(509) as u32).collect()).collect();
    let file = tmp.path().join("prompts.txt");
    let lines: Vec<String> =
        prompts.iter().map(|p| p.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")).collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let max_new = 24;
    let want = run_tokens(&bundle, &weights, &file, max_new);
    assert_eq!(want.len(), 64);

    let server = Server::start(&bundle, &weights, &["--start", "tp"]);
    let got = client(&py, &["streams", &server.url, file.to_str().unwrap(), &max_new.to_string()]);
    assert_eq!(got["model"], "tiny-qwen3");
    let results = got["results"].as_array().unwrap();
    assert_eq!(results.len(), 64);
    let tok = moeforge_server::text::Text::load(&weights).unwrap().unwrap();
    let eos = eos();
    for (i, (r, w)) in results.iter().zip(&want).enumerate() {
        assert_eq!(w.len(), max_new);
        let (w, finish) = until_eos(w, eos);
        assert_eq!(ids(&r["ids"]), w, "request {i}: the stream's token ids are `moeforge run`'s");
        assert_eq!(r["finish"], finish, "request {i}");
        assert_eq!(r["text"], tok.decode(w), "request {i}: the chunks' text is the decoding of its ids");
    }
    // The run switched under that load, and every request's KV is free again.
    assert!(metric(&server.url, "moeforge_switches_total") >= 1.0, "no switch under 64 streams");
    assert_eq!(metric(&server.url, "moeforge_kv_pages_used"), 0.0);
    assert_eq!(metric(&server.url, "moeforge_requests_running"), 0.0);
    assert_eq!(metric(&server.url, "moeforge_requests_total"), 64.0);
}

#[test]
fn curl_sees_the_openai_wire_format_and_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, "5 6 7 8").unwrap();
    let want = run_tokens(&bundle, &weights, &file, 6).remove(0);
    let (want, finish) = until_eos(&want, eos());
    let server = Server::start(&bundle, &weights, &[]);
    let u = &server.url;

    let (code, body) = curl(u, "/health", &[]);
    assert_eq!((code, json(&body)["status"].as_str()), (200, Some("ok")));
    let (code, body) = curl(u, "/v1/models", &[]);
    assert_eq!(code, 200);
    let m = json(&body);
    assert_eq!((m["object"].as_str(), m["data"][0]["id"].as_str()), (Some("list"), Some("tiny-qwen3")));

    // Token ids in, token ids and text out.
    let req = r#"{"model":"tiny-qwen3","prompt":[5,6,7,8],"max_tokens":6,"temperature":0}"#;
    let (code, body) = curl(u, "/v1/completions", &["-d", req]);
    assert_eq!(code, 200, "{body}");
    let r = json(&body);
    assert_eq!(r["object"], "text_completion");
    assert_eq!(ids(&r["choices"][0]["token_ids"]), want);
    assert_eq!(r["choices"][0]["finish_reason"], finish);
    assert_eq!(r["usage"]["prompt_tokens"], 4);
    assert_eq!(r["usage"]["completion_tokens"], want.len());

    // The same as a stream: SSE chunks, then [DONE].
    let req = r#"{"prompt":[5,6,7,8],"max_tokens":6,"temperature":0,"stream":true}"#;
    let (code, body) = curl(u, "/v1/completions", &["-N", "-d", req]);
    assert_eq!(code, 200);
    let data: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let streamed: Vec<u32> =
        data[..data.len() - 1].iter().flat_map(|d| ids(&json(d)["choices"][0]["token_ids"])).collect();
    assert_eq!(streamed, want);

    // A text prompt is tokenized as Hugging Face tokenizes it.
    let ex = json(&std::fs::read_to_string(root().join("tests/fixtures/tokenizer/expected.json")).unwrap());
    let case = &ex["encode"][1];
    let req = serde_json::json!({ "prompt": case["text"], "max_tokens": 2 }).to_string();
    let (code, body) = curl(u, "/v1/completions", &["-d", &req]);
    assert_eq!(code, 200, "{body}");
    assert_eq!(json(&body)["usage"]["prompt_tokens"], case["ids"].as_array().unwrap().len());
    assert!(json(&body)["choices"][0].get("token_ids").is_none(), "text prompts get text only");

    // Bad requests: 400 with an OpenAI error body naming the field.
    let capacity = {
        let plan = json(&std::fs::read_to_string(bundle.join("plan.json")).unwrap());
        plan["memory"]["kv"]["ep"]["pages"].as_u64().unwrap() * plan["memory"]["kv"]["page_tokens"].as_u64().unwrap()
    };
    let too_long = format!(r#"{{"prompt":[1,2],"max_tokens":{}}}"#, capacity.max(40_000));
    for (body, param) in [
        ("{not json", None),
        ("[1,2]", None),
        (r#"{"prompt":[1,2],"max_tokens":"x"}"#, None),
        (r#"{"max_tokens":3}"#, None),
        (r#"{"prompt":[1,2],"max_tokens":0}"#, Some("max_tokens")),
        (r#"{"prompt":[1,2],"max_tokens":-3}"#, Some("max_tokens")),
        (r#"{"prompt":[1,2],"temperature":9}"#, Some("temperature")),
        (r#"{"prompt":[1,2],"top_p":0}"#, Some("top_p")),
        (r#"{"prompt":[],"max_tokens":2}"#, Some("prompt")),
        (r#"{"prompt":[1,600],"max_tokens":2}"#, Some("prompt")),
        (&too_long, Some("max_tokens")),
    ] {
        let (code, resp) = curl(u, "/v1/completions", &["-d", body]);
        assert_eq!(code, 400, "{body} → {resp}");
        let e = json(&resp);
        assert_eq!(e["error"]["type"], "invalid_request_error", "{resp}");
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
        if let Some(p) = param {
            assert_eq!(e["error"]["param"], p, "{body} → {resp}");
        }
    }
    let (code, _) = curl(u, "/v1/completions", &["-d", r#"{"model":"gpt-4","prompt":[1]}"#]);
    assert_eq!(code, 404);
    // The server kept serving through all of that.
    let (code, _) = curl(u, "/v1/completions", &["-d", r#"{"prompt":[1,2],"max_tokens":1}"#]);
    assert_eq!(code, 200);
    assert_eq!(metric(u, "moeforge_requests_rejected_total"), 12.0);
}

#[test]
fn chat_uses_the_checkpoints_template() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    // The prompt transformers' apply_chat_template makes for this chat.
    let ex = json(&std::fs::read_to_string(root().join("tests/fixtures/tokenizer/expected.json")).unwrap());
    let prompt = ids(&ex["chat"][0]["ids"]);
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")).unwrap();
    let want = run_tokens(&bundle, &weights, &file, 12).remove(0);
    let (want, finish) = until_eos(&want, eos());
    let tok = moeforge_server::text::Text::load(&weights).unwrap().unwrap();

    let server = Server::start(&bundle, &weights, &[]);
    let r = client(&py, &["chat", &server.url]);
    assert_eq!(r["usage"][0], prompt.len(), "the chat prompt is transformers' token for token");
    assert_eq!(r["usage"][1], want.len());
    assert_eq!(r["content"], tok.decode(want));
    assert_eq!((r["role"].as_str(), r["finish"].as_str()), (Some("assistant"), Some(finish)));
    assert_eq!(r["streamed"], r["content"]);
    assert_eq!(r["stream_roles"], serde_json::json!(["assistant"]));
    assert_eq!(r["stream_finish"], finish);
}

#[test]
fn a_full_queue_answers_429_and_clients_that_leave_free_their_kv() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let server = Server::start(&bundle, &weights, &["--max-queue", "2"]);
    let r = client(&py, &["queue", &server.url]);
    assert_eq!(r["refused"]["status"], 429, "{r}");
    // Both held streams were cancelled by their clients leaving: the
    // engine dropped them and freed their pages.
    let t0 = Instant::now();
    while metric(&server.url, "moeforge_requests_cancelled_total") < 2.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "the left streams were not cancelled");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&server.url, "moeforge_kv_pages_used"), 0.0);
    assert_eq!(metric(&server.url, "moeforge_requests_running"), 0.0);
    // Neither ran to its 400 tokens.
    assert!(metric(&server.url, "moeforge_tokens_out_total") < 800.0);
    // The queue has room again.
    let (code, _) = curl(&server.url, "/v1/completions", &["-d", r#"{"prompt":[1,2],"max_tokens":1}"#]);
    assert_eq!(code, 200);
}

#[test]
fn bad_requests_through_the_openai_client() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let server = Server::start(&bundle, &weights, &[]);
    let r = client(&py, &["errors", &server.url]);
    for (case, status, param) in [
        ("max_tokens_zero", 400, Some("max_tokens")),
        ("too_long", 400, Some("max_tokens")),
        ("bad_token", 400, Some("prompt")),
        ("bad_temperature", 400, Some("temperature")),
        ("unknown_model", 404, Some("model")),
    ] {
        assert_eq!(r[case]["status"], status, "{case}: {r}");
        if let Some(p) = param {
            assert_eq!(r[case]["param"], p, "{case}: {r}");
        }
    }
}

#[test]
fn sigterm_drains_the_streams_in_flight() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, "9 8 7").unwrap();
    let max_new = 120;
    let want = run_tokens(&bundle, &weights, &file, max_new).remove(0);
    let (want, finish) = until_eos(&want, eos());
    let mut server = Server::start(&bundle, &weights, &[]);
    let mut c = Command::new(&py)
        .arg(root().join("tests/clients/openai_check.py"))
        .args(["drain", &server.url, &max_new.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "started");
    let status = server.terminate();
    assert!(status.success(), "the server exits cleanly after draining: {status}");
    let last = lines.last().unwrap().unwrap();
    assert!(c.wait().unwrap().success());
    let r = json(&last);
    assert_eq!(ids(&r["ids"]), want, "the stream ran to its end through the shutdown");
    assert_eq!(r["finish"], finish);
    // Nothing is accepted any more.
    let o = Command::new("curl").args(["-sS", &format!("{}/health", server.url)]).output().unwrap();
    assert!(!o.status.success());
}

/// The emulated device's process dies under a live server (what a GPU
/// that faults or falls off the bus looks like to the engine): the request
/// in flight fails with the device's error, and from then on the server is
/// out of service, `/health` 503 with the error, every request 503, instead
/// of a healthy-looking server whose every step fails.
#[test]
fn a_lost_device_puts_the_server_out_of_service() {
    let tmp = tempfile::tempdir().unwrap();
    let (bundle, weights) = setup(tmp.path());
    let server = Server::start(&bundle, &weights, &["--backend", "emu"]);
    let u = &server.url;
    let ask = r#"{"prompt":[5,6,7,8],"max_tokens":4,"temperature":0}"#;
    let (code, body) = curl(u, "/v1/completions", &["-d", ask]);
    // (Its tokens are not compared: this model's random weights leave
    // near-ties that the device's bf16 kernels and the twin can break
    // differently; `hf_twin`'s emulated-device tests pin its numerics.)
    assert_eq!(code, 200, "{body}");
    assert!(!ids(&json(&body)["choices"][0]["token_ids"]).is_empty(), "{body}");
    // Its decode steps ran as graphs on the emulated device, recorded before
    // serving (`serve`'s default there: both modes' buckets 1, 2, 4 and 8):
    // its three decode steps each a replay.
    assert_eq!(metric(u, "moeforge_decode_graphs"), 8.0);
    assert_eq!(metric(u, "moeforge_decode_graph_replays_total"), 3.0);
    // The device is the server's child process.
    let o = Command::new("pgrep").args(["-P", &server.child.id().to_string()]).output().unwrap();
    let device = text(&o.stdout);
    assert!(!device.trim().is_empty(), "no device process under the server");
    for pid in device.split_whitespace() {
        assert!(Command::new("kill").args(["-KILL", pid]).status().unwrap().success());
    }
    let (code, body) = curl(u, "/v1/completions", &["-d", ask]);
    assert_eq!(code, 500, "{body}");
    let msg = json(&body)["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("out of service"), "{msg}");
    let (code, body) = curl(u, "/health", &[]);
    assert_eq!(code, 503, "{body}");
    let h = json(&body);
    assert_eq!(h["status"], "out_of_service");
    assert!(h["error"].as_str().is_some_and(|e| !e.is_empty()), "{h}");
    let (code, body) = curl(u, "/v1/completions", &["-d", ask]);
    assert_eq!(code, 503, "{body}");
    assert_eq!(metric(u, "moeforge_engine_out_of_service"), 1.0);
    assert_eq!(metric(u, "moeforge_step_failures_total"), 1.0);
}
