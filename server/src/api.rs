//! The OpenAI wire format: requests as clients send them (validated field
//! by field into a [`Job`]), responses and stream chunks, and the error body
//! (`{"error": {"message", "type", "param", "code"}}`).

use crate::text::Message;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

/// An error as OpenAI's API returns it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into(), param }
    }
    pub fn busy(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            message: message.into(),
            param: None,
        }
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some("model"),
        }
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
        }
    }
    /// The engine is out of service (503): retrying here will not help.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, kind: "server_error", message: message.into(), param: None }
    }
    pub fn body(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": Value::Null } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `prompt`: a string, a list of token ids, or a one-element list of either.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    TextList(Vec<String>),
    IdsList(Vec<Vec<u32>>),
}

/// `stop`: a string or a list of strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The fields both endpoints share.
#[derive(Clone, Debug, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub n: Option<i64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub common: Common,
}

/// Tokens to generate when a request does not say.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// A request's validated parameters.
#[derive(Clone, Debug)]
pub struct Params {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
}

impl Common {
    pub fn params(&self) -> Result<Params, ApiError> {
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            None => DEFAULT_MAX_TOKENS,
            Some(n) if n >= 1 => {
                usize::try_from(n).map_err(|_| ApiError::bad("max_tokens is too large", Some("max_tokens")))?
            }
            Some(n) => {
                return Err(ApiError::bad(format!("max_tokens must be at least 1, got {n}"), Some("max_tokens")))
            }
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(ApiError::bad(
                format!("temperature must be in [0, 2], got {temperature}"),
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad(format!("top_p must be in (0, 1], got {top_p}"), Some("top_p")));
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only n = 1 is served", Some("n")));
        }
        let stop = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::bad("stop holds up to 4 non-empty strings", Some("stop")));
        }
        Ok(Params { max_tokens, temperature, top_p, seed: self.seed, stop, stream: self.stream.unwrap_or(false) })
    }
}

/// Parses a JSON body into `T`, as a 400 with serde's message otherwise.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the body is not JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object", None));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))
}
