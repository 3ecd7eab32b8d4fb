//! Reading one block's fields with typed getters that record diagnostics.
//!
//! Every getter marks its key as known; [`Fields::finish`] then reports the
//! items nobody asked for (with a "did you mean" hint). Getters return `None`
//! when the value is absent-and-required or invalid, after pushing the
//! diagnostic, so a lowering function can read every field first and only
//! then combine them: all errors of a block are reported, not just the first.

use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::source::Span;
use crate::syntax::{Block, Ident, Item, Value, ValueKind};
use crate::units::{self, Dim};
use std::collections::BTreeMap;

/// Where lowering records the span of every field it read, by dotted path.
pub type SpanMap = BTreeMap<String, Span>;

pub struct Fields<'a, 'd> {
    block: &'a Block,
    path: String,
    used: Vec<bool>,
    known: Vec<&'static str>,
    pub diags: &'d mut Diagnostics,
    pub spans: &'d mut SpanMap,
}

impl<'a, 'd> Fields<'a, 'd> {
    /// Starts reading `block`; reports duplicated keys right away.
    pub fn new(block: &'a Block, path: &str, diags: &'d mut Diagnostics, spans: &'d mut SpanMap) -> Self {
        let mut first: BTreeMap<&str, &Ident> = BTreeMap::new();
        for item in &block.items {
            let key = item.key();
            if let Some(prev) = first.get(key.text.as_str()) {
                diags.push(
                    Diagnostic::new(Code::DuplicateField, format!("`{}` is given twice", key.text))
                        .at(key.span, "second definition")
                        .also(prev.span, "first defined here")
                        .help("remove one of them"),
                );
            } else {
                first.insert(&key.text, key);
            }
        }
        Fields { block, path: path.to_string(), used: vec![false; block.items.len()], known: vec![], diags, spans }
    }

    /// The span used for "missing field" errors: the block's head.
    pub fn head(&self) -> Span {
        let b = self.block;
        match &b.name {
            Some(n) => Span { end: n.span.end, ..b.kind.span },
            None => b.kind.span,
        }
    }

    fn what(&self) -> String {
        match &self.block.name {
            Some(n) => format!("`{} {}`", self.block.kind.text, n.text),
            None => format!("`{}`", self.block.kind.text),
        }
    }

    fn item(&mut self, key: &'static str) -> Option<&'a Item> {
        if !self.known.contains(&key) {
            self.known.push(key);
        }
        let idx = self.block.items.iter().position(|i| i.key().text == key)?;
        self.used[idx] = true;
        let item = &self.block.items[idx];
        self.spans.insert(format!("{}.{key}", self.path), item.key().span);
        Some(item)
    }

    pub fn missing(&mut self, key: &str, example: &str) {
        let d = Diagnostic::new(Code::MissingField, format!("{} is missing `{key}`", self.what()))
            .at(self.head(), format!("needs `{key}`"))
            .help(format!("add `{example}` inside the block"));
        self.diags.push(d);
    }

    /// A `key = value` field.
    pub fn value(&mut self, key: &'static str) -> Option<&'a Value> {
        match self.item(key)? {
            Item::Field(f) => Some(&f.value),
            Item::Block(b) => {
                self.diags.push(
                    Diagnostic::new(Code::WrongType, format!("`{key}` is a value, not a block"))
                        .at(b.kind.span, "expected `=` and a value")
                        .help(format!("write `{key} = …`")),
                );
                None
            }
        }
    }

    /// A required `key = value`.
    pub fn req_value(&mut self, key: &'static str, example: &str) -> Option<&'a Value> {
        let known = self.block.items.iter().any(|i| i.key().text == key);
        let v = self.value(key);
        if !known {
            self.missing(key, example);
        }
        v
    }

    /// A nested block `key [name] { … }`.
    pub fn sub_block(&mut self, key: &'static str) -> Option<&'a Block> {
        match self.item(key)? {
            Item::Block(b) => Some(b),
            Item::Field(f) => {
                self.diags.push(
                    Diagnostic::new(Code::WrongType, format!("`{key}` is a block, not a value"))
                        .at(f.value.span, "expected `{ … }`")
                        .help(format!("write `{key} {{ … }}`")),
                );
                None
            }
        }
    }

    pub fn req_block(&mut self, key: &'static str, example: &str) -> Option<&'a Block> {
        let known = self.block.items.iter().any(|i| i.key().text == key);
        let b = self.sub_block(key);
        if !known {
            self.missing(key, example);
        }
        b
    }

    /// A field that selects a variant: `key = NAME` or `key NAME { params }`.
    /// Returns the variant name and its parameter block, if any.
    pub fn variant(&mut self, key: &'static str) -> Option<(Ident, Option<&'a Block>)> {
        match self.item(key)? {
            Item::Field(f) => match &f.value.kind {
                ValueKind::Ident(s) => Some((Ident { text: s.clone(), span: f.value.span }, None)),
                other => {
                    self.diags.push(wrong_type(&f.value, &format!("a name (e.g. `{key} = NAME`)"), other));
                    None
                }
            },
            Item::Block(b) => match &b.name {
                Some(n) => Some((n.clone(), Some(b))),
                None => {
                    self.diags.push(
                        Diagnostic::new(Code::BlockName, format!("`{key}` needs a kind"))
                            .at(b.kind.span, "kind missing after this")
                            .help(format!("write `{key} KIND {{ … }}`")),
                    );
                    None
                }
            },
        }
    }

    pub fn req_variant(&mut self, key: &'static str, example: &str) -> Option<(Ident, Option<&'a Block>)> {
        let known = self.block.items.iter().any(|i| i.key().text == key);
        let v = self.variant(key);
        if !known {
            self.missing(key, example);
        }
        v
    }

    // ── typed getters ──

    pub fn req_count(&mut self, key: &'static str, lo: u64, hi: u64) -> Option<u32> {
        let v = self.req_value(key, &format!("{key} = {lo}"))?;
        count(self.diags, key, v, lo, hi)
    }

    /// `Some(default)` when absent, `None` when present and invalid.
    pub fn opt_count(&mut self, key: &'static str, lo: u64, hi: u64, default: u32) -> Option<u32> {
        match self.value(key) {
            Some(v) => count(self.diags, key, v, lo, hi),
            None if self.has_invalid(key) => None,
            None => Some(default),
        }
    }

    pub fn maybe_count(&mut self, key: &'static str, lo: u64, hi: u64) -> Result<Option<u32>, ()> {
        match self.value(key) {
            Some(v) => count(self.diags, key, v, lo, hi).map(Some).ok_or(()),
            None if self.has_invalid(key) => Err(()),
            None => Ok(None),
        }
    }

    pub fn req_qty(&mut self, key: &'static str, dim: Dim, lo: f64, hi: f64, example: &str) -> Option<f64> {
        let v = self.req_value(key, &format!("{key} = {example}"))?;
        quantity(self.diags, key, v, dim, lo, hi)
    }

    pub fn opt_qty(&mut self, key: &'static str, dim: Dim, lo: f64, hi: f64, default: f64) -> Option<f64> {
        match self.value(key) {
            Some(v) => quantity(self.diags, key, v, dim, lo, hi),
            None if self.has_invalid(key) => None,
            None => Some(default),
        }
    }

    pub fn maybe_qty(&mut self, key: &'static str, dim: Dim, lo: f64, hi: f64) -> Result<Option<f64>, ()> {
        match self.value(key) {
            Some(v) => quantity(self.diags, key, v, dim, lo, hi).map(Some).ok_or(()),
            None if self.has_invalid(key) => Err(()),
            None => Ok(None),
        }
    }

    pub fn opt_bool(&mut self, key: &'static str, default: bool) -> Option<bool> {
        match self.value(key) {
            Some(v) => choice(self.diags, key, v, &[("true", true), ("false", false)]),
            None if self.has_invalid(key) => None,
            None => Some(default),
        }
    }

    pub fn req_choice<T: Copy>(&mut self, key: &'static str, choices: &[(&str, T)]) -> Option<T> {
        let example = format!("{key} = {}", choices.first().map_or("…", |c| c.0));
        let v = self.req_value(key, &example)?;
        choice(self.diags, key, v, choices)
    }

    pub fn opt_choice<T: Copy>(&mut self, key: &'static str, choices: &[(&str, T)], default: T) -> Option<T> {
        match self.value(key) {
            Some(v) => choice(self.diags, key, v, choices),
            None if self.has_invalid(key) => None,
            None => Some(default),
        }
    }

    /// A required reference to another block by name.
    pub fn req_name(&mut self, key: &'static str, example: &str) -> Option<Ident> {
        let v = self.req_value(key, &format!("{key} = {example}"))?;
        match &v.kind {
            ValueKind::Ident(s) => Some(Ident { text: s.clone(), span: v.span }),
            other => {
                self.diags.push(wrong_type(v, "a name", other));
                None
            }
        }
    }

    /// A list of exactly `N` counts, e.g. `cluster = [2, 1]`.
    pub fn count_list<const N: usize>(&mut self, key: &'static str, lo: u64, hi: u64) -> Result<Option<[u32; N]>, ()> {
        let Some(v) = self.value(key) else {
            return if self.has_invalid(key) { Err(()) } else { Ok(None) };
        };
        let ValueKind::List(items) = &v.kind else {
            self.diags.push(wrong_type(v, &format!("a list of {N} numbers"), &v.kind));
            return Err(());
        };
        if items.len() != N {
            self.diags.push(
                Diagnostic::new(Code::WrongType, format!("`{key}` needs {N} numbers, found {}", items.len()))
                    .at(v.span, format!("{} element(s)", items.len()))
                    .help(format!("write `{key} = [{}]`", vec!["1"; N].join(", "))),
            );
            return Err(());
        }
        let mut out = [0u32; N];
        let mut ok = true;
        for (slot, item) in out.iter_mut().zip(items) {
            match count(self.diags, key, item, lo, hi) {
                Some(c) => *slot = c,
                None => ok = false,
            }
        }
        if ok {
            Ok(Some(out))
        } else {
            Err(())
        }
    }

    /// A list of names, each one of `choices`.
    pub fn choice_list<T: Copy>(&mut self, key: &'static str, choices: &[(&str, T)]) -> Option<Vec<T>> {
        let example = format!("{key} = [{}]", choices.iter().map(|c| c.0).collect::<Vec<_>>().join(", "));
        let v = self.req_value(key, &example)?;
        let ValueKind::List(items) = &v.kind else {
            self.diags.push(wrong_type(v, "a list of names", &v.kind));
            return None;
        };
        if items.is_empty() {
            self.diags.push(
                Diagnostic::new(Code::OutOfRange, format!("`{key}` is empty"))
                    .at(v.span, "needs at least one element")
                    .help(format!("write `{example}`")),
            );
            return None;
        }
        let out: Vec<Option<T>> = items.iter().map(|i| choice(self.diags, key, i, choices)).collect();
        out.into_iter().collect()
    }

    /// Whether `key` is present but not a plain value (already reported).
    fn has_invalid(&self, key: &str) -> bool {
        self.block.items.iter().any(|i| matches!(i, Item::Block(b) if b.kind.text == key))
    }

    /// A field moeforge no longer reads: an error that says so (instead of
    /// "unknown field"), so an old spec learns why its line is refused.
    pub fn removed(&mut self, key: &str, why: &str) {
        if let Some(i) = self.block.items.iter().position(|it| it.key().text == key) {
            self.used[i] = true;
            let span = self.block.items[i].key().span;
            self.diags.push(
                Diagnostic::new(Code::UnknownField, format!("`{key}` was removed from {}: {why}", self.what()))
                    .at(span, "no longer a field")
                    .help("delete this line"),
            );
        }
    }

    /// Reports every item no getter asked for.
    pub fn finish(self) {
        for (item, used) in self.block.items.iter().zip(&self.used) {
            if *used {
                continue;
            }
            let key = item.key();
            if self.known.contains(&key.text.as_str()) {
                continue; // a duplicate, already reported
            }
            let mut d = Diagnostic::new(Code::UnknownField, format!("{} has no field `{}`", self.what(), key.text))
                .at(key.span, "unknown field");
            d = match suggest(&key.text, &self.known) {
                Some(s) => d.help(format!("did you mean `{s}`?")),
                None => d.help(format!("the fields of {} are: {}", self.what(), self.known.join(", "))),
            };
            self.diags.push(d);
        }
    }
}

pub fn wrong_type(v: &Value, expected: &str, found: &ValueKind) -> Diagnostic {
    Diagnostic::new(Code::WrongType, format!("expected {expected}, found {}", found.describe()))
        .at(v.span, format!("expected {expected}"))
        .help(format!("replace this with {expected}"))
}

/// A positive integer without unit, in `lo..=hi`.
pub fn count(diags: &mut Diagnostics, key: &str, v: &Value, lo: u64, hi: u64) -> Option<u32> {
    let ValueKind::Number { value, text, unit } = &v.kind else {
        diags.push(wrong_type(v, "a whole number", &v.kind));
        return None;
    };
    if !unit.is_empty() {
        diags.push(
            Diagnostic::new(Code::UnitMismatch, format!("`{key}` is a plain count, but has unit `{unit}`"))
                .at(v.span, "unexpected unit")
                .help(format!("write `{key} = {text}`")),
        );
        return None;
    }
    let is_int = !text.contains(['.', 'e', 'E']) && value.fract() == 0.0;
    if !is_int || !value.is_finite() || *value < lo as f64 || *value > hi as f64 {
        diags.push(
            Diagnostic::new(Code::OutOfRange, format!("`{key}` must be a whole number in {lo}..={hi}, found {text}"))
                .at(v.span, "out of range")
                .help(format!("use a whole number between {lo} and {hi}")),
        );
        return None;
    }
    u32::try_from(*value as u64).ok()
}

/// A number whose unit has dimension `dim`, converted to base units, in `lo..=hi`.
pub fn quantity(diags: &mut Diagnostics, key: &str, v: &Value, dim: Dim, lo: f64, hi: f64) -> Option<f64> {
    let ValueKind::Number { text, unit, .. } = &v.kind else {
        diags.push(wrong_type(v, &format!("{dim}"), &v.kind));
        return None;
    };
    let Some((got, factor)) = units::parse_unit(unit) else {
        diags.push(
            Diagnostic::new(Code::UnknownUnit, format!("unknown unit `{unit}`")).at(v.span, "unknown unit").help(
                "units: B KB MB GB TB KiB MiB GiB (and b Kb Mb Gb for bits), ns us ms s, GB/s Gb/s, TFLOP/s, req/s, %",
            ),
        );
        return None;
    };
    if got != dim {
        let found = if unit.is_empty() { "no unit".to_string() } else { format!("`{unit}`, {got}") };
        diags.push(
            Diagnostic::new(Code::UnitMismatch, format!("`{key}` needs {dim}, found {found}"))
                .at(v.span, "wrong unit")
                .help(format!("give `{key}` {dim}")),
        );
        return None;
    }
    let base = units::to_base(text, factor);
    if !base.is_finite() || base < lo || base > hi {
        diags.push(
            Diagnostic::new(Code::OutOfRange, format!("`{key}` = {text}{unit} is out of range"))
                .at(v.span, "out of range")
                .help(format!("use a value between {} and {}", units::human(lo, dim), units::human(hi, dim))),
        );
        return None;
    }
    Some(base)
}

/// A name that must be one of `choices`.
pub fn choice<T: Copy>(diags: &mut Diagnostics, key: &str, v: &Value, choices: &[(&str, T)]) -> Option<T> {
    let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
    let ValueKind::Ident(s) = &v.kind else {
        diags.push(wrong_type(v, &format!("one of {}", names.join(", ")), &v.kind));
        return None;
    };
    if let Some((_, t)) = choices.iter().find(|c| c.0 == s) {
        return Some(*t);
    }
    let mut d =
        Diagnostic::new(Code::UnknownVariant, format!("`{s}` is not a valid `{key}`")).at(v.span, "unknown choice");
    d = match suggest(s, &names) {
        Some(g) => d.help(format!("did you mean `{g}`? (choices: {})", names.join(", "))),
        None => d.help(format!("choose one of: {}", names.join(", "))),
    };
    diags.push(d);
    None
}

/// The closest name within a small edit distance, for "did you mean".
pub fn suggest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    if a.len() > 64 || b.len() > 64 {
        return usize::MAX;
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let sub = prev[j - 1] + usize::from(a[i - 1] != b[j - 1]);
            cur[j] = sub.min(prev[j] + 1).min(cur[j - 1] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
