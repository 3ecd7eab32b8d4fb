//! Text in and out: the checkpoint's tokenizer (`tokenizer.json` beside the
//! weights, read with Hugging Face's `tokenizers`), its chat template
//! (`tokenizer_config.json`'s `chat_template`, rendered with minijinja as
//! transformers renders it with Jinja2), incremental detokenization for
//! streams, and stop strings.

use serde::Serialize;
use std::path::Path;

/// A checkpoint's tokenizer and chat template.
pub struct Text {
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos: Option<String>,
    eos: Option<String>,
    /// Token ids that end generation (the EOS token, when the vocabulary has it).
    pub stop_ids: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{path}: {err}")]
    Load { path: String, err: String },
    #[error("the prompt cannot be tokenized: {0}")]
    Encode(String),
    #[error("the checkpoint has no chat template (tokenizer_config.json's `chat_template`)")]
    NoTemplate,
    #[error("the chat template failed: {0}")]
    Template(String),
}

/// A chat message as the OpenAI API and chat templates see it.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A special token in tokenizer_config.json: a string or `{"content": …}`.
fn token_of(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl Text {
    /// The tokenizer of the checkpoint in `dir`, or `None` when it has no
    /// `tokenizer.json` (then only token-id prompts are served).
    pub fn load(dir: &Path) -> Result<Option<Text>, TextError> {
        let tpath = dir.join("tokenizer.json");
        if !tpath.is_file() {
            return Ok(None);
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tpath)
            .map_err(|e| TextError::Load { path: tpath.display().to_string(), err: e.to_string() })?;
        let cpath = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&cpath) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| TextError::Load { path: cpath.display().to_string(), err: e.to_string() })?,
            Err(_) => serde_json::Value::Null,
        };
        let template = config.get("chat_template").and_then(|t| t.as_str()).map(str::to_string);
        let (bos, eos) = (token_of(config.get("bos_token")), token_of(config.get("eos_token")));
        let stop_ids = eos.as_deref().and_then(|e| tokenizer.token_to_id(e)).into_iter().collect();
        Ok(Some(Text { tokenizer, template, bos, eos, stop_ids }))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// The prompt of a chat: the template applied to the messages with the
    /// generation prompt appended.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String, TextError> {
        let template = self.template.as_deref().ok_or(TextError::NoTemplate)?;
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", template).map_err(|e| TextError::Template(e.to_string()))?;
        let t = env.get_template("chat").map_err(|e| TextError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }
}

/// A stream's text so far, emitted as the new suffix after each token
/// (whole characters only: a token that ends mid-character waits for the
/// next), with stop strings cut off.
pub struct Detok<'a> {
    text: &'a Text,
    ids: Vec<u32>,
    emitted: usize,
    stops: &'a [String],
}

impl<'a> Detok<'a> {
    pub fn new(text: &'a Text, stops: &'a [String]) -> Detok<'a> {
        Detok { text, ids: Vec::new(), emitted: 0, stops }
    }

    /// Adds a token; returns the new text to emit and whether a stop string
    /// (or the EOS token) ended the stream.
    pub fn push(&mut self, id: u32) -> (String, bool) {
        if self.text.stop_ids.contains(&id) {
            return (String::new(), true);
        }
        self.ids.push(id);
        let full = self.text.decode(&self.ids);
        if let Some(at) = self.stops.iter().filter_map(|s| full.find(s.as_str())).min() {
            let new = full.get(self.emitted..at).unwrap_or("").to_string();
            self.emitted = at.max(self.emitted);
            return (new, true);
        }
        // Hold back a trailing replacement character (an incomplete UTF-8
        // sequence) and any suffix of the rest that may begin a stop string:
        // each stop's longest proper prefix ending the text, measured from
        // the same end (a char boundary, since the prefix is whole characters).
        let whole = full.trim_end_matches('\u{fffd}').len();
        let mut end = whole;
        for s in self.stops {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && full[..whole].ends_with(&s[..k]) {
                    end = end.min(whole - k);
                    break;
                }
            }
        }
        let end = end.max(self.emitted);
        let new = full.get(self.emitted..end).unwrap_or("").to_string();
        self.emitted = end;
        (new, false)
    }

    /// What is left to emit once the stream ended without a stop.
    pub fn flush(&mut self) -> String {
        let full = self.text.decode(&self.ids);
        let new = full.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = full.len();
        new
    }

    /// The whole completion text so far.
    pub fn text(&self) -> String {
        let full = self.text.decode(&self.ids);
        full.get(..self.emitted).unwrap_or(&full).to_string()
    }
}
