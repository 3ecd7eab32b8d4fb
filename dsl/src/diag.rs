//! Diagnostics: errors as data, rendered in one place.
//!
//! Every problem the checker (or a later stage) finds is a [`Diagnostic`] with a
//! stable [`Code`], a primary span, optional secondary spans and a help line.
//! All diagnostics of a run are collected in [`Diagnostics`] and rendered
//! either for humans (miette, with file:line:col and an underline) or as JSON.

use crate::source::{SourceMap, Span};
use serde::Serialize;
use std::fmt;

macro_rules! codes {
    ($($(#[$doc:meta])* $name:ident = $code:literal,)*) => {
        /// Stable diagnostic codes. The number never changes meaning; retired
        /// codes are not reused.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Code { $($(#[$doc])* $name,)* }
        impl Code {
            pub fn as_str(self) -> &'static str {
                match self { $(Code::$name => $code,)* }
            }
            /// Every code, for documentation and tests.
            pub const ALL: &'static [Code] = &[$(Code::$name,)*];
        }
    };
}

codes! {
    /// The text is not valid `.moe` syntax.
    Syntax = "E0001",
    /// A `use`d file cannot be read.
    UseNotFound = "E0002",
    /// A file `use`s itself, directly or through other files.
    CircularUse = "E0003",
    /// A top-level block kind other than model, cluster, tiles or deploy.
    UnknownBlockKind = "E0100",
    /// A reference to a block name that is not declared.
    UnknownName = "E0101",
    /// Two blocks of the same kind share a name.
    DuplicateName = "E0102",
    /// A field or sub-block appears twice in one block.
    DuplicateField = "E0103",
    /// A required field or sub-block is missing.
    MissingField = "E0104",
    /// A field or sub-block the block does not define.
    UnknownField = "E0105",
    /// A quantity has the wrong unit, or none where one is needed.
    UnitMismatch = "E0106",
    /// A number is outside the range its field allows.
    OutOfRange = "E0107",
    /// A value of the wrong kind (a name where a number is expected, …).
    WrongType = "E0108",
    /// A name that is not one of the field's allowed choices.
    UnknownVariant = "E0109",
    /// An unknown unit suffix.
    UnknownUnit = "E0110",
    /// A block is missing its name, or has one where none is allowed.
    BlockName = "E0111",
    /// `top_k` exceeds the number of routed experts (or the routing group limits).
    TopKExceedsExperts = "E0120",
    /// Attention heads are not divisible by KV heads.
    HeadsNotDivisible = "E0121",
    /// Values in one block contradict each other.
    Inconsistent = "E0122",
    /// A tile's pipeline needs more shared memory than one block may use.
    TileSmemExceeded = "E0130",
    /// A tile's block size is not a multiple of the target's MMA shape.
    TileNotMmaMultiple = "E0131",
    /// A CTA-cluster shape the target cannot launch.
    TileCluster = "E0132",
    /// The model's weights cannot fit in the cluster's HBM at all.
    WeightsDoNotFit = "E0140",
    /// Inconsistent deployment parameters (switch thresholds, fractions, …).
    InconsistentDeploy = "E0141",
    /// The spec is valid but a later stage does not support it yet.
    Unsupported = "E0200",
    /// The file holds no deployment, or several and none was chosen.
    NoDeployment = "E0201",
    /// A moeforge bug: a plan broke an invariant its passes guarantee.
    Internal = "E0900",
    /// A field that parses and checks but has no effect yet (warning).
    NoEffect = "W0100",
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A span with a short message pointing at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub span: Span,
    pub text: String,
}

/// Whether a diagnostic stops the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Severity {
    #[default]
    Error,
    /// Reported, but the spec is accepted.
    Warning,
}

/// One located problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub code: Code,
    pub severity: Severity,
    pub message: String,
    /// Where the problem is. `None` only for problems with no source location
    /// (e.g. the top-level file cannot be read).
    pub primary: Option<Label>,
    pub secondary: Vec<Label>,
    pub help: Option<String>,
}

impl Diagnostic {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Diagnostic {
            code,
            severity: Severity::Error,
            message: message.into(),
            primary: None,
            secondary: vec![],
            help: None,
        }
    }
    /// A warning: reported, but the spec is accepted.
    pub fn warning(code: Code, message: impl Into<String>) -> Self {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::new(code, message) }
    }
    pub fn at(mut self, span: Span, text: impl Into<String>) -> Self {
        self.primary = Some(Label { span, text: text.into() });
        self
    }
    pub fn also(mut self, span: Span, text: impl Into<String>) -> Self {
        self.secondary.push(Label { span, text: text.into() });
        self
    }
    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// Diagnostics a terminal rendering shows (the rest are counted).
const MAX_RENDERED: usize = 50;

/// The furthest column a snippet is drawn for; past it a diagnostic is
/// rendered in its plain one-line form.
const MAX_COLUMN: usize = 1000;

/// All diagnostics of one run, in the order they were found.
#[derive(Clone, Debug, Default, PartialEq, Eq, thiserror::Error)]
#[error("{} error(s)", .0.len())]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn push(&mut self, d: Diagnostic) {
        self.0.push(d);
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn iter(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter()
    }
    pub fn extend(&mut self, other: Diagnostics) {
        self.0.extend(other.0);
    }

    /// Renders for a terminal (`color` adds ANSI styling). Each diagnostic
    /// names its file:line:col, underlines the span and prints the help line.
    pub fn render(&self, sources: &SourceMap, color: bool) -> String {
        let theme = if color { miette::GraphicalTheme::unicode() } else { miette::GraphicalTheme::unicode_nocolor() };
        let handler = miette::GraphicalReportHandler::new_themed(theme).with_width(100);
        let mut out = String::new();
        for d in self.0.iter().take(MAX_RENDERED) {
            // A label far along a line (a column miette cannot pad to, or a
            // snippet too wide to read) gets the plain form, with its help.
            let far = d
                .primary
                .iter()
                .chain(&d.secondary)
                .any(|l| sources.line_col(l.span.file, l.span.start).1 > MAX_COLUMN);
            if far {
                out.push_str(&plain(d, sources));
                if let Some(h) = &d.help {
                    out.push_str(&format!("  help: {h}\n"));
                }
                out.push('\n');
                continue;
            }
            let m = MietteDiag::new(d, sources);
            // Rendering into a String cannot fail; fall back to the plain form anyway.
            if handler.render_report(&mut out, &m).is_err() {
                out.push_str(&plain(d, sources));
            }
            out.push('\n');
        }
        if self.0.len() > MAX_RENDERED {
            out.push_str(&format!(
                "… and {} more (the first {MAX_RENDERED} are shown; `--format json` lists every one)\n",
                self.0.len() - MAX_RENDERED
            ));
        }
        let errors = self.0.iter().filter(|d| d.severity == Severity::Error).count();
        let warnings = self.0.len() - errors;
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        if errors > 0 {
            out.push_str(&format!("error: {errors} error{} found\n", plural(errors)));
        }
        if warnings > 0 {
            out.push_str(&format!("warning: {warnings} warning{}\n", plural(warnings)));
        }
        out
    }

    /// Machine-readable form: a JSON array, one object per diagnostic.
    pub fn to_json(&self, sources: &SourceMap) -> serde_json::Value {
        let items: Vec<JsonDiag> = self.0.iter().map(|d| JsonDiag::new(d, sources)).collect();
        serde_json::to_value(items).unwrap_or(serde_json::Value::Null)
    }
}

impl Severity {
    pub fn name(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

fn plain(d: &Diagnostic, sources: &SourceMap) -> String {
    match &d.primary {
        Some(l) => {
            let (line, col) = sources.line_col(l.span.file, l.span.start);
            format!("{}[{}]: {} at {}:{line}:{col}\n", d.severity.name(), d.code, d.message, sources.name(l.span.file))
        }
        None => format!("{}[{}]: {}\n", d.severity.name(), d.code, d.message),
    }
}

#[derive(Serialize)]
struct JsonLabel {
    file: String,
    line: usize,
    col: usize,
    end_line: usize,
    end_col: usize,
    message: String,
}

#[derive(Serialize)]
struct JsonDiag {
    code: &'static str,
    severity: &'static str,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    primary: Option<JsonLabel>,
    secondary: Vec<JsonLabel>,
    #[serde(skip_serializing_if = "Option::is_none")]
    help: Option<String>,
}

impl JsonDiag {
    fn new(d: &Diagnostic, sources: &SourceMap) -> Self {
        let label = |l: &Label| {
            let (line, col) = sources.line_col(l.span.file, l.span.start);
            let (end_line, end_col) = sources.line_col(l.span.file, l.span.end);
            JsonLabel {
                file: sources.name(l.span.file).to_string(),
                line,
                col,
                end_line,
                end_col,
                message: l.text.clone(),
            }
        };
        JsonDiag {
            code: d.code.as_str(),
            severity: d.severity.name(),
            message: d.message.clone(),
            primary: d.primary.as_ref().map(label),
            secondary: d.secondary.iter().map(label).collect(),
            help: d.help.clone(),
        }
    }
}

/// Owned adapter from [`Diagnostic`] to miette's trait. Secondary labels in
/// another file than the primary one become related sub-reports, so each
/// label is shown against its own source.
#[derive(Debug)]
struct MietteDiag {
    /// `None` for a note attached to another diagnostic.
    code: Option<&'static str>,
    severity: Severity,
    message: String,
    help: Option<String>,
    src: Option<miette::NamedSource<String>>,
    labels: Vec<miette::LabeledSpan>,
    related: Vec<MietteDiag>,
}

impl MietteDiag {
    fn new(d: &Diagnostic, sources: &SourceMap) -> Self {
        let mut labels = Vec::new();
        let mut related = Vec::new();
        let src = d.primary.as_ref().map(|p| {
            labels.push(miette::LabeledSpan::new_primary_with_span(Some(p.text.clone()), p.span.range()));
            for s in &d.secondary {
                if s.span.file == p.span.file {
                    labels.push(miette::LabeledSpan::new_with_span(Some(s.text.clone()), s.span.range()));
                } else {
                    related.push(MietteDiag {
                        code: None,
                        severity: d.severity,
                        message: s.text.clone(),
                        help: None,
                        src: Some(named(sources, s.span)),
                        labels: vec![miette::LabeledSpan::new_primary_with_span(Some(s.text.clone()), s.span.range())],
                        related: vec![],
                    });
                }
            }
            named(sources, p.span)
        });
        MietteDiag {
            code: Some(d.code.as_str()),
            severity: d.severity,
            message: d.message.clone(),
            help: d.help.clone(),
            src,
            labels,
            related,
        }
    }
}

fn named(sources: &SourceMap, span: Span) -> miette::NamedSource<String> {
    miette::NamedSource::new(sources.name(span.file), sources.text(span.file).to_string())
}

impl fmt::Display for MietteDiag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for MietteDiag {}

impl miette::Diagnostic for MietteDiag {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.code.map(|c| Box::new(c) as Box<dyn fmt::Display>)
    }
    fn severity(&self) -> Option<miette::Severity> {
        Some(match (self.code, self.severity) {
            (None, _) => miette::Severity::Advice,
            (Some(_), Severity::Error) => miette::Severity::Error,
            (Some(_), Severity::Warning) => miette::Severity::Warning,
        })
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.src.as_ref().map(|s| s as &dyn miette::SourceCode)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        if self.labels.is_empty() {
            None
        } else {
            Some(Box::new(self.labels.iter().cloned()))
        }
    }
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn miette::Diagnostic> + 'a>> {
        if self.related.is_empty() {
            None
        } else {
            Some(Box::new(self.related.iter().map(|r| r as &dyn miette::Diagnostic)))
        }
    }
}
