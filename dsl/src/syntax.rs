//! Parsing: `.moe` text to a syntax tree that keeps spans.
//!
//! The tree is generic (blocks of fields and nested blocks); it knows nothing
//! of models or clusters. `lower.rs` gives it meaning. Parsing never panics:
//! nesting is bounded before pest runs, so pathological input cannot exhaust
//! the stack.

use crate::diag::{Code, Diagnostic};
use crate::source::{FileId, Span};
use pest::Parser;

#[derive(pest_derive::Parser)]
#[grammar = "grammar.pest"]
struct MoeParser;

/// Deepest allowed nesting of `{` and `[`.
pub const MAX_NESTING: usize = 32;

#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub text: String,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Use {
    pub path: String,
    pub span: Span,
}

/// `KIND NAME? { items }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub kind: Ident,
    pub name: Option<Ident>,
    pub items: Vec<Item>,
    /// From the kind to the closing brace.
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Field(Field),
    Block(Block),
}

impl Item {
    pub fn key(&self) -> &Ident {
        match self {
            Item::Field(f) => &f.key,
            Item::Block(b) => &b.kind,
        }
    }
}

/// `key = value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    pub key: Ident,
    pub value: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// A number with its unit suffix (empty when none). `text` is the numeral
    /// as written, for exact integer checks.
    Number {
        value: f64,
        text: String,
        unit: String,
    },
    Str(String),
    Ident(String),
    List(Vec<Value>),
}

impl ValueKind {
    /// How a value kind is named in messages.
    pub fn describe(&self) -> &'static str {
        match self {
            ValueKind::Number { unit, .. } if unit.is_empty() => "a number",
            ValueKind::Number { .. } => "a quantity",
            ValueKind::Str(_) => "a string",
            ValueKind::Ident(_) => "a name",
            ValueKind::List(_) => "a list",
        }
    }
}

/// A parsed file: its `use` statements and top-level blocks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    pub uses: Vec<Use>,
    pub blocks: Vec<Block>,
}

type Pair<'i> = pest::iterators::Pair<'i, Rule>;

/// Parses one file. On a syntax error returns the single located diagnostic
/// (a syntax error leaves nothing sensible to check further in that file).
pub fn parse(file: FileId, text: &str) -> Result<File, Diagnostic> {
    let unclosed = check_nesting(file, text)?;
    let mut pairs = MoeParser::parse(Rule::file, text).map_err(|e| syntax_error(file, text, e, unclosed))?;
    let mut out = File::default();
    let Some(root) = pairs.next() else {
        return Ok(out);
    };
    for p in root.into_inner() {
        match p.as_rule() {
            Rule::use_stmt => {
                let span = span(file, &p);
                let path = p.into_inner().next().map(|s| s.into_inner().as_str().to_string()).unwrap_or_default();
                out.uses.push(Use { path, span });
            }
            Rule::block => out.blocks.push(block(file, p)),
            _ => {}
        }
    }
    Ok(out)
}

fn span(file: FileId, p: &Pair<'_>) -> Span {
    let s = p.as_span();
    Span::new(file, s.start(), s.end())
}

fn ident(file: FileId, p: Pair<'_>) -> Ident {
    Ident { text: p.as_str().to_string(), span: span(file, &p) }
}

fn block(file: FileId, p: Pair<'_>) -> Block {
    let whole = span(file, &p);
    let mut kind = None;
    let mut name = None;
    let mut items = Vec::new();
    for c in p.into_inner() {
        match c.as_rule() {
            Rule::ident if kind.is_none() => kind = Some(ident(file, c)),
            Rule::ident => name = Some(ident(file, c)),
            Rule::field => items.push(Item::Field(field(file, c))),
            Rule::block => items.push(Item::Block(block(file, c))),
            _ => {}
        }
    }
    let kind = kind.unwrap_or(Ident { text: String::new(), span: whole });
    Block { kind, name, items, span: whole }
}

fn field(file: FileId, p: Pair<'_>) -> Field {
    let whole = span(file, &p);
    let mut inner = p.into_inner();
    let key = inner.next().map(|k| ident(file, k)).unwrap_or(Ident { text: String::new(), span: whole });
    let value = inner.next().map(|v| value(file, v)).unwrap_or(Value { kind: ValueKind::List(vec![]), span: whole });
    Field { key, value }
}

fn value(file: FileId, p: Pair<'_>) -> Value {
    let sp = span(file, &p);
    let kind = match p.as_rule() {
        Rule::list => ValueKind::List(p.into_inner().map(|v| value(file, v)).collect()),
        Rule::number => {
            let mut text = String::new();
            let mut unit = String::new();
            for c in p.into_inner() {
                match c.as_rule() {
                    Rule::numeral => text = c.as_str().to_string(),
                    Rule::unit => unit = c.as_str().to_string(),
                    _ => {}
                }
            }
            // The grammar admits only valid float syntax, so parse succeeds;
            // overflow gives infinity, which range checks report.
            let value = text.parse::<f64>().unwrap_or(f64::NAN);
            ValueKind::Number { value, text, unit }
        }
        Rule::string => ValueKind::Str(p.into_inner().next().map(|s| s.as_str().to_string()).unwrap_or_default()),
        _ => ValueKind::Ident(p.as_str().to_string()),
    };
    Value { kind, span: sp }
}

/// Rejects nesting deeper than [`MAX_NESTING`] before the recursive parser
/// runs. Returns the offset of the innermost `{` or `[` left unclosed, if any,
/// so that an "unexpected end of file" can point at it.
fn check_nesting(file: FileId, text: &str) -> Result<Option<usize>, Diagnostic> {
    let mut open: Vec<usize> = Vec::new();
    let mut in_str = false;
    let mut in_comment = false;
    let mut prev = '\0';
    for (i, ch) in text.char_indices() {
        if in_comment {
            if ch == '\n' {
                in_comment = false;
            }
        } else if in_str {
            if ch == '"' || ch == '\n' {
                in_str = false;
            }
        } else {
            match ch {
                '"' => in_str = true,
                '/' if prev == '/' => in_comment = true,
                '{' | '[' => {
                    open.push(i);
                    if open.len() > MAX_NESTING {
                        return Err(Diagnostic::new(Code::Syntax, "blocks and lists are nested too deeply")
                            .at(Span::new(file, i, i + 1), format!("nesting level {}", open.len()))
                            .help(format!(
                                "a spec needs far less than {MAX_NESTING} levels; check for an unclosed `{{` or `[`"
                            )));
                    }
                }
                '}' | ']' => {
                    open.pop();
                }
                _ => {}
            }
        }
        prev = if in_comment { '\0' } else { ch };
    }
    Ok(open.last().copied())
}

fn rule_name(r: &Rule) -> &'static str {
    match r {
        Rule::EOI => "end of file",
        Rule::file => "a block or `use`",
        Rule::use_stmt => "`use \"file.moe\"`",
        Rule::block => "a block",
        Rule::field => "a field (`name = value`)",
        Rule::item => "a field or a block",
        Rule::value | Rule::list | Rule::number | Rule::string => "a value",
        Rule::numeral => "a number",
        Rule::unit | Rule::unit_word => "a unit",
        Rule::string_inner => "string text",
        Rule::ident => "a name",
        Rule::WHITESPACE | Rule::COMMENT => "whitespace",
    }
}

fn syntax_error(file: FileId, text: &str, e: pest::error::Error<Rule>, unclosed: Option<usize>) -> Diagnostic {
    let (start, end) = match e.location {
        pest::error::InputLocation::Pos(p) => (p, next_char_end(text, p)),
        pest::error::InputLocation::Span((s, e)) => (s, e.max(s)),
    };
    let found = text[start.min(text.len())..]
        .chars()
        .next()
        .map_or("end of file".to_string(), |c| format!("`{}`", c.escape_default()));
    let expected = match &e.variant {
        pest::error::ErrorVariant::ParsingError { positives, .. } => {
            let is_value =
                |r: &Rule| matches!(r, Rule::value | Rule::list | Rule::number | Rule::string | Rule::numeral);
            let any_value = positives.iter().any(is_value);
            let mut names: Vec<&str> = positives
                .iter()
                .map(|r| if any_value && (is_value(r) || *r == Rule::ident) { "a value" } else { rule_name(r) })
                .collect();
            names.dedup();
            let mut seen = Vec::new();
            for n in names {
                if !seen.contains(&n) {
                    seen.push(n);
                }
            }
            seen
        }
        pest::error::ErrorVariant::CustomError { .. } => vec![],
    };
    let (msg, label) = if expected.is_empty() {
        (format!("unexpected {found}"), "unexpected here".to_string())
    } else {
        (format!("expected {}, found {found}", expected.join(" or ")), format!("expected {}", expected.join(" or ")))
    };
    if start >= text.len() {
        if let Some(open) = unclosed {
            let ch = &text[open..open + 1];
            let close = if ch == "{" { "}" } else { "]" };
            return Diagnostic::new(Code::Syntax, format!("unexpected end of file: this `{ch}` is never closed"))
                .at(Span::new(file, open, open + 1), "opened here")
                .help(format!("add the missing `{close}`"));
        }
    }
    Diagnostic::new(Code::Syntax, msg)
        .at(Span::new(file, start, end), label)
        .help("a file holds `use \"path.moe\"` lines and blocks like `model NAME { key = value … }`; fields are `name = value`, values are numbers with optional units, names, strings or `[lists]`")
}

fn next_char_end(text: &str, p: usize) -> usize {
    text.get(p..).and_then(|s| s.chars().next()).map_or(p, |c| p + c.len_utf8())
}
