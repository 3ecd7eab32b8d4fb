//! Source files, their loading, and `use` resolution.
//!
//! A [`SourceMap`] owns the text of every file a check touched, keyed by a
//! [`FileId`]. Files are read through a [`Loader`], so the same checker runs on
//! the file system (the CLI), on an in-memory table (the embedded default spec,
//! tests, the fuzzer) and at Rust compile time (the proc-macro).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// Index of a file in a [`SourceMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileId(pub u32);

/// A byte range in one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    pub file: FileId,
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(file: FileId, start: usize, end: usize) -> Self {
        let clamp = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Span { file, start: clamp(start), end: clamp(end.max(start)) }
    }
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// One loaded file.
#[derive(Clone, Debug)]
pub struct SourceFile {
    /// The name shown in diagnostics (the path as given, normalized).
    pub name: String,
    pub text: String,
}

/// Every file read during one check.
#[derive(Clone, Debug, Default)]
pub struct SourceMap {
    files: Vec<SourceFile>,
}

impl SourceMap {
    pub fn add(&mut self, name: String, text: String) -> FileId {
        let id = FileId(u32::try_from(self.files.len()).unwrap_or(u32::MAX));
        self.files.push(SourceFile { name, text });
        id
    }
    pub fn get(&self, id: FileId) -> Option<&SourceFile> {
        self.files.get(id.0 as usize)
    }
    pub fn name(&self, id: FileId) -> &str {
        self.get(id).map_or("<unknown>", |f| f.name.as_str())
    }
    pub fn text(&self, id: FileId) -> &str {
        self.get(id).map_or("", |f| f.text.as_str())
    }
    pub fn files(&self) -> impl Iterator<Item = (FileId, &SourceFile)> {
        self.files.iter().enumerate().map(|(i, f)| (FileId(i as u32), f))
    }
    /// 1-based line and column (in characters) of a byte offset.
    pub fn line_col(&self, file: FileId, offset: u32) -> (usize, usize) {
        let text = self.text(file);
        let mut off = (offset as usize).min(text.len());
        while !text.is_char_boundary(off) {
            off -= 1;
        }
        let before = &text[..off];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }
}

/// Reads spec files by path. Paths are normalized lexically (`a/../b` → `b`)
/// before they reach the loader, so in-memory tables need no `..` handling.
pub trait Loader {
    fn load(&self, path: &Path) -> Result<String, String>;
}

/// Loads from the file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsLoader;

/// The largest spec file read (specs are kilobytes; a device or a huge
/// file named by mistake must not be read to its end).
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

impl Loader for FsLoader {
    fn load(&self, path: &Path) -> Result<String, String> {
        use std::io::Read;
        // Before opening: opening a FIFO blocks until something writes to it.
        let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
        if !meta.is_file() {
            return Err("not a regular file (a spec is a text file)".into());
        }
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        if meta.len() > MAX_SPEC_BYTES {
            return Err(format!("{} bytes: a spec file holds at most {MAX_SPEC_BYTES}", meta.len()));
        }
        let mut text = String::new();
        // A file that grew since: still read at most the bound (and one byte, to see it).
        file.take(MAX_SPEC_BYTES + 1).read_to_string(&mut text).map_err(|e| e.to_string())?;
        if text.len() as u64 > MAX_SPEC_BYTES {
            return Err(format!("more than {MAX_SPEC_BYTES} bytes: a spec file holds at most that"));
        }
        Ok(text)
    }
}

/// Loads from a fixed table of (path, text) pairs.
#[derive(Clone, Debug, Default)]
pub struct MemLoader {
    files: BTreeMap<PathBuf, String>,
}

impl MemLoader {
    pub fn new<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        MemLoader { files: files.into_iter().map(|(p, t)| (normalize(Path::new(p)), t.to_string())).collect() }
    }
    pub fn insert(&mut self, path: &str, text: &str) {
        self.files.insert(normalize(Path::new(path)), text.to_string());
    }
}

impl Loader for MemLoader {
    fn load(&self, path: &Path) -> Result<String, String> {
        self.files.get(&normalize(path)).cloned().ok_or_else(|| "no such file".to_string())
    }
}

/// Lexical normalization: drops `.`, folds `dir/..`; keeps leading `..`.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out: Vec<Component> = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir) | Some(Component::Prefix(_)) => {}
                _ => out.push(c),
            },
            _ => out.push(c),
        }
    }
    out.iter().collect()
}
