//! The server's text path against Hugging Face's own libraries: the
//! fixture's expected values come from `tokenizers` and `transformers`
//! (scripts/fixtures/tokenizer.py), not from this crate.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_server::text::{Detok, Message, Text};
use serde_json::Value;
use std::path::PathBuf;

fn fixture() -> (Text, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let text = Text::load(&dir).expect("the fixture loads").expect("the fixture has a tokenizer");
    let expected = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    (text, expected)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn encodes_as_hugging_face_tokenizers_does() {
    let (text, ex) = fixture();
    for case in ex["encode"].as_array().unwrap() {
        let t = case["text"].as_str().unwrap();
        assert_eq!(text.encode(t).unwrap(), ids(&case["ids"]), "encoding {t:?}");
    }
}

#[test]
fn eos_ends_generation() {
    let (text, ex) = fixture();
    assert_eq!(text.stop_ids, vec![ex["eos_id"].as_u64().unwrap() as u32]);
    let mut d = Detok::new(&text, &[]);
    assert_eq!(d.push(text.stop_ids[0]), (String::new(), true));
}

#[test]
fn streamed_text_is_the_whole_decoding() {
    // Random id sequences, byte-level pieces of partial UTF-8 included:
    // the chunks a stream emits concatenate to what `tokenizers` decodes.
    let (text, ex) = fixture();
    for case in ex["decode"].as_array().unwrap() {
        let want = case["text"].as_str().unwrap();
        assert_eq!(text.decode(&ids(&case["ids"])), want);
        let mut d = Detok::new(&text, &[]);
        let mut got = String::new();
        for id in ids(&case["ids"]) {
            let (s, stop) = d.push(id);
            assert!(!stop);
            got.push_str(&s);
        }
        got.push_str(&d.flush());
        assert_eq!(got, want, "streaming {:?}", case["ids"]);
    }
}

/// Streams `tokenizers`' encoding of `full` through a detokenizer with
/// `stops`: the text emitted until a stop ended the stream (then `true`),
/// or all of it, the final flush included (then `false`).
fn stream(text: &Text, full: &str, stops: &[String]) -> (String, bool) {
    let mut d = Detok::new(text, stops);
    let mut got = String::new();
    for id in text.encode(full).unwrap() {
        let (s, end) = d.push(id);
        got.push_str(&s);
        if end {
            return (got, true);
        }
    }
    got.push_str(&d.flush());
    (got, false)
}

#[test]
fn stop_strings_cut_the_text_before_them() {
    let (text, _) = fixture();
    let full = "The quick brown fox jumps over the lazy dog.";
    for stop in ["fox", "lazy dog", " o", "."] {
        let (got, stopped) = stream(&text, full, &[stop.to_string()]);
        assert!(stopped, "{stop:?} stops the stream");
        assert_eq!(got, full[..full.find(stop).unwrap()], "text before {stop:?}");
    }
}

/// Several stops, some of several-byte characters, each a possible start
/// of the text's tail: what is held back is the longest such tail, and
/// what is emitted is always whole characters of the decoding. The text's
/// pieces come from `tokenizers`' encoding of it (the fixture), the
/// expected cut from `str::find`.
#[test]
fn non_ascii_stops_hold_back_whole_characters() {
    let (text, _) = fixture();
    let prix = "Prix: 5€ ou 5£, été à Zürich. fin";
    for (full, stops) in [
        ("Prix: 5€a et 5€ab", vec!["ab", "€q", "zz"]),
        ("Prix: 5€a et 5€ab", vec!["zz", "€q", "ab"]),
        (prix, vec!["€ ou", "£,", "é"]),
        (prix, vec!["Zü", "ürich", "h. f"]),
        (prix, vec!["ü", "€", "£"]),
        (prix, vec!["x€", "5€", "ou 5£"]),
        (prix, vec!["€q", "£q", "éq"]),
    ] {
        let stops: Vec<String> = stops.into_iter().map(String::from).collect();
        let (got, stopped) = stream(&text, full, &stops);
        let first = stops.iter().filter_map(|s| full.find(s.as_str())).min();
        match first {
            Some(at) => {
                assert!(stopped, "{stops:?} stops the stream");
                assert_eq!(got, full[..at], "text before {stops:?}");
            }
            None => {
                assert!(!stopped, "{stops:?} is not in the text");
                assert_eq!(got, full, "the whole text with {stops:?}");
            }
        }
    }
}

#[test]
fn chat_prompts_are_transformers_apply_chat_template() {
    let (text, ex) = fixture();
    for case in ex["chat"].as_array().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let prompt = text.chat_prompt(&messages).unwrap();
        assert_eq!(prompt, case["prompt"].as_str().unwrap());
        assert_eq!(text.encode(&prompt).unwrap(), ids(&case["ids"]));
    }
}

#[test]
fn a_bad_role_is_the_templates_error() {
    let (text, _) = fixture();
    let m = vec![Message { role: "robot".into(), content: "hi".into() }];
    let err = text.chat_prompt(&m).unwrap_err().to_string();
    assert!(err.contains("unknown role: robot"), "{err}");
}
