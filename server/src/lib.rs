//! `moeforge-server`: an OpenAI-compatible HTTP server over any engine.
//!
//! Takes an engine behind the runtime's step-level interface (under the
//! switch-policy driver, so the policy runs live under load) and serves
//! `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming with
//! `"stream": true`), `GET /v1/models`, `GET /health` and `GET /metrics`
//! (Prometheus text). The engine runs on a thread of its own
//! ([`engine_loop`]); HTTP handlers talk to it through channels, so any
//! backend plugs in. Batching is continuous with the engine's admission
//! rule; the queue is bounded (429 beyond it); bad requests get 400 with an
//! OpenAI-style error body; a client that disconnects cancels its request
//! and frees its KV; shutdown stops accepting and drains what is in flight.
//! A backend failure puts the engine out of service: the requests in flight
//! fail with its message, later ones get 503, and `GET /health` answers 503
//! with the error ([`engine_loop::Health`]).

pub mod api;
pub mod engine_loop;
pub mod metrics;
pub mod text;

use api::{ApiError, ChatRequest, CompletionRequest, Params, Prompt};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine_loop::{Command, Event, Health};
use metrics::Metrics;
use moeforge_runtime::engine::{Engine, EngineError, Request, RequestId, Sampling};
use moeforge_runtime::policy::Driver;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use text::{Detok, Text};
use tokio::sync::{mpsc as tmpsc, oneshot};

/// How the server presents itself and how much it queues.
pub struct Config {
    /// The model id clients address (`GET /v1/models`).
    pub model: String,
    /// Other names a request's `model` may use (the model's own name).
    pub aliases: Vec<String>,
    /// Requests accepted and not finished beyond which new ones get 429.
    pub max_queue: usize,
    /// The checkpoint's tokenizer and chat template, if it has them.
    pub text: Option<Text>,
}

struct AppState {
    commands: Mutex<mpsc::Sender<Command>>,
    text: Option<Text>,
    metrics: Arc<Metrics>,
    model: String,
    aliases: Vec<String>,
    max_queue: usize,
    inflight: AtomicUsize,
    next_id: AtomicU64,
    health: Arc<Health>,
}

type Shared = Arc<AppState>;

/// Serves on `listener` until `shutdown` resolves, then drains: no new
/// connections; requests in flight (streams included) run to their end;
/// the engine thread ends when the last of them did.
pub async fn serve<E, F>(
    listener: tokio::net::TcpListener,
    driver: Driver<E>,
    cfg: Config,
    shutdown: F,
) -> std::io::Result<()>
where
    E: Engine + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let metrics = Arc::new(Metrics::new().map_err(std::io::Error::other)?);
    let (tx, rx) = mpsc::channel();
    let (m, health) = (metrics.clone(), Arc::new(Health::default()));
    let h = health.clone();
    // A panic in the engine (a bug) ends its thread; the server then says
    // so as for a backend failure, instead of looking healthy with no engine.
    let engine = std::thread::Builder::new().name("moeforge-engine".into()).spawn(move || {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine_loop::run(driver, rx, &m, &h)));
        if let Err(p) = ran {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            h.fail(engine_loop::Failure { step: None, message: format!("it panicked: {why}") });
            m.out_of_service.set(1);
        }
    })?;
    let state = Arc::new(AppState {
        commands: Mutex::new(tx),
        text: cfg.text,
        metrics,
        model: cfg.model,
        aliases: cfg.aliases,
        max_queue: cfg.max_queue.max(1),
        inflight: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        health,
    });
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health_check))
        .route("/metrics", get(metrics_text))
        .with_state(state);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    // Every handler and stream is done: the engine's command channel closes.
    tokio::task::spawn_blocking(move || engine.join())
        .await
        .map_err(std::io::Error::other)?
        .map_err(|_| std::io::Error::other("the engine thread panicked"))
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Ends a request's life on the server: on drop (a finished request, or a
/// client gone mid-stream) the engine forgets it and the queue frees a slot.
struct Ticket {
    state: Shared,
    id: RequestId,
    done: bool,
}

impl Ticket {
    /// The engine is done with the request: dropping need not cancel it.
    fn close(&mut self) {
        self.done = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            if let Ok(c) = self.state.commands.lock() {
                let _ = c.send(Command::Cancel(self.id));
            }
        }
        self.state.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Submits `prompt` to the engine; `Ok` once the engine accepted it.
async fn submit(
    state: &Shared,
    prompt: Vec<u32>,
    p: &Params,
) -> Result<(Ticket, tmpsc::UnboundedReceiver<Event>), ApiError> {
    if let Some(f) = state.health.failure() {
        state.metrics.rejected.inc();
        return Err(ApiError::unavailable(f.refusal()));
    }
    if state.inflight.fetch_add(1, Ordering::SeqCst) >= state.max_queue {
        state.inflight.fetch_sub(1, Ordering::SeqCst);
        state.metrics.rejected.inc();
        return Err(ApiError::busy(format!("the server holds {} requests; retry later", state.max_queue)));
    }
    let id = state.next_id.fetch_add(1, Ordering::SeqCst);
    let ticket = Ticket { state: state.clone(), id, done: false };
    let sampling = Sampling { temperature: p.temperature, top_p: p.top_p, seed: p.seed.unwrap_or(id) };
    let req = Request::new(id, prompt, p.max_tokens).with_sampling(sampling);
    let (accepted, answer) = oneshot::channel();
    let (events, rx) = tmpsc::unbounded_channel();
    let sent =
        state.commands.lock().map(|c| c.send(Command::Submit { req, accepted, events }).is_ok()).unwrap_or(false);
    if !sent {
        return Err(ApiError::unavailable(stopped(state)));
    }
    match answer.await {
        Ok(Ok(())) => {
            state.metrics.requests.inc();
            Ok((ticket, rx))
        }
        Ok(Err(e)) => {
            let mut t = ticket;
            t.close();
            drop(t);
            state.metrics.rejected.inc();
            Err(match e {
                EngineError::BadRequest(m) => ApiError::bad(m, Some("prompt")),
                EngineError::Capacity(m) => {
                    ApiError::bad(format!("prompt + max_tokens do not fit: {m}"), Some("max_tokens"))
                }
                EngineError::Backend(m) => ApiError::unavailable(m),
            })
        }
        Err(_) => Err(ApiError::unavailable(stopped(state))),
    }
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model.as_deref() {
        None | Some("") => Ok(()),
        Some(m) if m == state.model || state.aliases.iter().any(|a| a == m) => Ok(()),
        Some(m) => {
            Err(ApiError::not_found(format!("the model `{m}` does not exist; this server serves `{}`", state.model)))
        }
    }
}

/// The prompt's token ids, and whether the client sent ids (then choices
/// carry `token_ids`).
fn prompt_ids(state: &AppState, prompt: Prompt) -> Result<(Vec<u32>, bool), ApiError> {
    let text = match prompt {
        Prompt::Ids(ids) => return Ok((ids, true)),
        Prompt::IdsList(mut v) if v.len() == 1 => return Ok((v.remove(0), true)),
        Prompt::Text(t) => t,
        Prompt::TextList(mut v) if v.len() == 1 => v.remove(0),
        _ => return Err(ApiError::bad("one prompt per request", Some("prompt"))),
    };
    let tk = state.text.as_ref().ok_or_else(|| {
        ApiError::bad("this checkpoint has no tokenizer.json: send the prompt as token ids", Some("prompt"))
    })?;
    Ok((tk.encode(&text).map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))?, false))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(state): State<Shared>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let r = (|| {
        let req: CompletionRequest = api::parse(&body)?;
        check_model(&state, &req.common.model)?;
        let p = req.common.params()?;
        let (ids, as_ids) = prompt_ids(&state, req.prompt)?;
        Ok::<_, ApiError>((ids, as_ids, p))
    })();
    state.metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
    match r {
        Ok((ids, as_ids, p)) => {
            let with_ids = as_ids || noted(&state);
            respond(state, Kind::Completion, ids, with_ids, p).await
        }
        Err(e) => {
            state.metrics.rejected.inc();
            e.into_response()
        }
    }
}

async fn chat(State(state): State<Shared>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let r = (|| {
        let req: ChatRequest = api::parse(&body)?;
        check_model(&state, &req.common.model)?;
        let p = req.common.params()?;
        let tk = state.text.as_ref().ok_or_else(|| {
            ApiError::bad("chat needs the checkpoint's tokenizer.json and chat template", Some("messages"))
        })?;
        let prompt = tk.chat_prompt(&req.messages).map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        let ids = tk.encode(&prompt).map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        Ok::<_, ApiError>((ids, p))
    })();
    state.metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
    match r {
        Ok((ids, p)) => respond(state, Kind::Chat, ids, false, p).await,
        Err(e) => {
            state.metrics.rejected.inc();
            e.into_response()
        }
    }
}

/// What a request the engine dropped without an answer is told: the
/// failure that put it out of service, if one was recorded.
fn stopped(state: &AppState) -> String {
    state
        .health
        .failure()
        .map_or_else(|| "the engine stopped before the request finished; restart the server".into(), |f| f.refusal())
}

/// Without a tokenizer every choice carries its token ids.
fn noted(state: &AppState) -> bool {
    state.text.is_none()
}

/// One choice's text accumulator: detokenized with stop strings when the
/// checkpoint has a tokenizer, ids only otherwise.
struct Output<'a> {
    detok: Option<Detok<'a>>,
    ids: Vec<u32>,
}

impl<'a> Output<'a> {
    fn new(text: Option<&'a Text>, stops: &'a [String]) -> Output<'a> {
        Output { detok: text.map(|t| Detok::new(t, stops)), ids: Vec::new() }
    }
    /// Adds a token: the text to emit and whether a stop ended the choice.
    fn push(&mut self, id: u32) -> (String, bool) {
        match &mut self.detok {
            Some(d) => {
                let (s, stop) = d.push(id);
                if !stop {
                    self.ids.push(id);
                }
                (s, stop)
            }
            None => {
                self.ids.push(id);
                (String::new(), false)
            }
        }
    }
    fn flush(&mut self) -> String {
        self.detok.as_mut().map(Detok::flush).unwrap_or_default()
    }
}

fn choice(kind: Kind, text: &str, ids: Option<&[u32]>, finish: Option<&str>, delta: bool, first: bool) -> Value {
    let mut c = match (kind, delta) {
        (Kind::Completion, _) => json!({ "index": 0, "text": text, "logprobs": Value::Null, "finish_reason": finish }),
        (Kind::Chat, false) => {
            json!({ "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": Value::Null, "finish_reason": finish })
        }
        (Kind::Chat, true) => {
            let d = if first {
                json!({ "role": "assistant", "content": text })
            } else if finish.is_some() && text.is_empty() {
                json!({})
            } else {
                json!({ "content": text })
            };
            json!({ "index": 0, "delta": d, "logprobs": Value::Null, "finish_reason": finish })
        }
    };
    if let (Some(ids), Some(o)) = (ids, c.as_object_mut()) {
        o.insert("token_ids".into(), json!(ids));
    }
    c
}

fn object(kind: Kind, stream: bool) -> &'static str {
    match (kind, stream) {
        (Kind::Completion, _) => "text_completion",
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
    }
}

async fn respond(state: Shared, kind: Kind, prompt: Vec<u32>, with_ids: bool, p: Params) -> Response {
    let prompt_tokens = prompt.len();
    if !p.stop.is_empty() && state.text.is_none() {
        return ApiError::bad("stop strings need the checkpoint's tokenizer.json", Some("stop")).into_response();
    }
    let (mut ticket, mut events) = match submit(&state, prompt, &p).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let id = format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, ticket.id);
    let created = now_secs();
    let model = state.model.clone();
    if !p.stream {
        let text = state.text.as_ref();
        let mut out = Output::new(text, &p.stop);
        let mut s = String::new();
        let mut finish = "length";
        let mut ended = false;
        while let Some(ev) = events.recv().await {
            let t0 = Instant::now();
            match ev {
                Event::Token(t) => {
                    let (new, stop) = out.push(t);
                    s.push_str(&new);
                    if stop {
                        finish = "stop";
                        ended = true;
                        break;
                    }
                }
                Event::Done => {
                    ticket.close();
                    s.push_str(&out.flush());
                    ended = true;
                    break;
                }
                Event::Failed(m) => {
                    ticket.close();
                    return ApiError::internal(m).into_response();
                }
            }
            state.metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
        }
        if !ended {
            // The engine went away mid-request (its thread stopped).
            return ApiError::unavailable(stopped(&state)).into_response();
        }
        let n = out.ids.len();
        let body = json!({
            "id": id, "object": object(kind, false), "created": created, "model": model,
            "choices": [choice(kind, &s, with_ids.then_some(&out.ids[..]), Some(finish), false, false)],
            "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n },
        });
        // A stop ended it early: the ticket cancels the rest in the engine.
        return (StatusCode::OK, axum::Json(body)).into_response();
    }
    let (tx, rx) = tmpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let st = ticket.state.clone();
        let mut out = Output::new(st.text.as_ref(), &p.stop);
        let chunk = |text: &str, ids: Option<&[u32]>, finish: Option<&str>, first: bool| {
            let v = json!({
                "id": id, "object": object(kind, true), "created": created, "model": model,
                "choices": [choice(kind, text, ids, finish, true, first)],
            });
            SseEvent::default().data(v.to_string())
        };
        let mut first = true;
        let mut finish = "length";
        let mut ended = false;
        while let Some(ev) = events.recv().await {
            let t0 = Instant::now();
            let (text, ids, end) = match ev {
                Event::Token(t) => {
                    let (new, stop) = out.push(t);
                    if stop {
                        finish = "stop";
                        ended = true;
                        break;
                    }
                    (new, vec![t], false)
                }
                Event::Done => {
                    ticket.close();
                    ended = true;
                    (out.flush(), vec![], true)
                }
                Event::Failed(m) => {
                    ticket.close();
                    let _ = tx.send(Ok(SseEvent::default().data(ApiError::internal(m).body().to_string()))).await;
                    return;
                }
            };
            if end && text.is_empty() {
                break;
            }
            // A token that completes no character yet: nothing to send
            // unless the client wants its id.
            if text.is_empty() && !with_ids && !end {
                continue;
            }
            let ev = chunk(&text, with_ids.then_some(&ids[..]), None, first);
            first = false;
            st.metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
            if tx.send(Ok(ev)).await.is_err() {
                return; // the client left: the ticket cancels the request
            }
            if end {
                break;
            }
        }
        if !ended {
            // The engine went away mid-stream (its thread stopped): an error
            // event, not a finished choice.
            ticket.close();
            let _ = tx.send(Ok(SseEvent::default().data(ApiError::unavailable(stopped(&st)).body().to_string()))).await;
            return;
        }
        let _ = tx.send(Ok(chunk("", with_ids.then_some(&[][..]), Some(finish), first))).await;
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        drop(ticket);
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

async fn models(State(state): State<Shared>) -> Response {
    let body = json!({ "object": "list", "data": [{ "id": state.model, "object": "model", "created": 0, "owned_by": "moeforge" }] });
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// 200 while the engine serves; 503 with the failure once a backend error
/// put it out of service (what a readiness or liveness probe reads).
async fn health_check(State(state): State<Shared>) -> Response {
    match state.health.failure() {
        None => (StatusCode::OK, axum::Json(json!({ "status": "ok" }))).into_response(),
        Some(f) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "status": "out_of_service", "failed_step": f.step, "error": f.message })),
        )
            .into_response(),
    }
}

async fn metrics_text(State(state): State<Shared>) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

/// Resolves on Ctrl-C or SIGTERM: the signal to drain and stop.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Binds `addr`, calls `on_listen` with the bound address (port 0 picks
/// one), and serves until Ctrl-C or SIGTERM, then drains: for commands that
/// have no async runtime of their own.
pub fn serve_blocking<E>(
    addr: &str,
    driver: Driver<E>,
    cfg: Config,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> std::io::Result<()>
where
    E: Engine + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("moeforge-http")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        on_listen(listener.local_addr()?);
        serve(listener, driver, cfg, shutdown_signal()).await
    })
}
