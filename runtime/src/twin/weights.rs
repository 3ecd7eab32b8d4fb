//! Checkpoints in safetensors with Hugging Face tensor names.
//!
//! Reads every `*.safetensors` file of a directory (sharded checkpoints
//! included) and normalizes the names of the supported families to one
//! canonical set (Qwen3-MoE's): Mixtral's and MiniMax-M2's
//! `block_sparse_moe.*` becomes `mlp.*`, their experts' `w1`/`w3`/`w2`
//! become `gate_proj`/`up_proj`/`down_proj`, MiniMax-M2's
//! `block_sparse_moe.e_score_correction_bias` becomes DeepSeek's
//! `mlp.gate.e_score_correction_bias` (widened to f32 if stored bf16), and
//! the fused expert tensors transformers 5 holds (`mlp.experts.gate_up_proj`,
//! `mlp.experts.down_proj`) are split per expert. `write_random` produces a small checkpoint in either
//! family's naming, for tests and demos.

use super::math::{bf16s, e4m3_to_f32};
use super::TwinModel;
use crate::reference::f32_to_bf16;
use std::collections::BTreeMap;
use std::path::Path;

/// Tensor naming of a checkpoint family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    Mixtral,
}

impl Family {
    pub fn parse(s: &str) -> Option<Family> {
        match s {
            "qwen3-moe" | "qwen3_moe" => Some(Family::Qwen3Moe),
            "mixtral" => Some(Family::Mixtral),
            _ => None,
        }
    }
}

/// A checkpoint tensor's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F32,
    /// fp8 e4m3 codes, scaled by the `<name>_scale_inv` f32 blocks beside them.
    F8E4m3,
}

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::F8E4m3 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F8E4m3 => "F8_E4M3",
        }
    }
}

/// A tensor: shape, element type, little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub data: Bytes,
}

/// A checkpoint file's bytes as loading holds them: read into memory
/// ([`read_file`]), or mapped (the cuda crate's `map_file`, where this
/// project's `unsafe` lives).
pub type FileBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Opens a checkpoint file for [`Checkpoint::load_with`].
pub type OpenFile<'a> = &'a dyn Fn(&Path) -> std::io::Result<FileBytes>;

/// The whole file, read.
pub fn read_file(path: &Path) -> std::io::Result<FileBytes> {
    Ok(std::sync::Arc::new(std::fs::read(path)?))
}

/// A tensor's bytes: a range of its checkpoint file (a tensor loaded as
/// stored, or a contiguous part of a fused one: no copy of its own; with a
/// mapped file, its pages are read when a view's slice is cut from them),
/// or bytes of its own (a tensor loading converted: widened, narrowed, or
/// unfused from GPT-OSS's interleaved layout).
#[derive(Clone)]
pub struct Bytes(Repr);

#[derive(Clone)]
enum Repr {
    /// Checked in range when made ([`Bytes::in_file`]; a file's bytes never change length).
    InFile {
        file: FileBytes,
        at: usize,
        len: usize,
    },
    Owned(Vec<u8>),
}

impl Bytes {
    /// Bytes `at..at + len` of `file`; `None` past its end.
    pub fn in_file(file: &FileBytes, at: usize, len: usize) -> Option<Bytes> {
        let end = at.checked_add(len)?;
        ((**file).as_ref().len() >= end).then(|| Bytes(Repr::InFile { file: std::sync::Arc::clone(file), at, len }))
    }

    /// Bytes `at..at + len` of these, sharing the file's where they are a
    /// file's; `None` past their end.
    pub fn sub(&self, at: usize, len: usize) -> Option<Bytes> {
        let end = at.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        match &self.0 {
            Repr::InFile { file, at: base, .. } => Bytes::in_file(file, base + at, len),
            Repr::Owned(v) => Some(Bytes(Repr::Owned(v[at..end].to_vec()))),
        }
    }

    /// Whether these are a range of a checkpoint file (no copy of their own).
    pub fn is_in_file(&self) -> bool {
        matches!(self.0, Repr::InFile { .. })
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            // In range by construction.
            Repr::InFile { file, at, len } => {
                (**file).as_ref().get(*at..).and_then(|b| b.get(..*len)).unwrap_or_default()
            }
            Repr::Owned(v) => v,
        }
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Bytes {
        Bytes(Repr::Owned(v))
    }
}

impl PartialEq for Bytes {
    fn eq(&self, other: &Bytes) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.is_in_file() { "in-file" } else { "owned" };
        write!(f, "{} {how} bytes", self.len())
    }
}

/// All tensors of a model under canonical names.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    pub tensors: BTreeMap<String, Tensor>,
    /// f32 tensors (other than the selection bias) stored as bf16 because
    /// the twin's views are bf16, whose values bf16 could not hold exactly.
    /// transformers saves DeepSeek-V3's router in f32 (`_keep_in_fp32_modules`);
    /// from bf16 weights that is exact and this stays empty.
    pub rounded: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: {err}")]
    Io { path: String, err: String },
    #[error("{path}: not a safetensors file: {err}")]
    Format { path: String, err: String },
    #[error("{name}: dtype {dtype}, but the model stores it as {expected}")]
    Dtype { name: String, dtype: String, expected: &'static str },
    #[error("no *.safetensors file in {0}")]
    Empty(String),
    #[error("tensor `{name}` is missing from the checkpoint (expected shape {shape:?})")]
    Missing { name: String, shape: Vec<usize> },
    #[error("tensor `{name}` has shape {found:?}, the spec implies {expected:?}")]
    Shape { name: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("tensor `{name}` has shape {found:?}: a fused expert tensor is [experts, {rows}, hidden or intermediate]")]
    Fused { name: String, found: Vec<usize>, rows: &'static str },
    #[error("tensor `{name}` is in the checkpoint but the model computes without it ({why}); refusing rather than ignoring it")]
    Unused { name: String, why: &'static str },
    #[error(
        "a random checkpoint of this model holds {params} parameters (about {gb:.1} GB): random checkpoints are for \
         test-sized models of at most {limit} parameters; serve a real checkpoint instead (`moeforge import-hf`)"
    )]
    TooLarge { params: u64, gb: f64, limit: u64 },
}

/// The most parameters [`write_random`] writes: it builds the checkpoint in
/// memory (2 bytes a parameter, and the largest tensor's f32 values), which
/// is for test-sized models.
pub const MAX_RANDOM_PARAMS: u64 = 1 << 30;

/// Canonical name of a checkpoint tensor name.
pub fn canonical(name: &str) -> String {
    let n = name
        .replace(".block_sparse_moe.", ".mlp.")
        .replace(".mlp.router.", ".mlp.gate.")
        .replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias");
    if n.contains(".mlp.experts.") {
        return n
            .replace(".w1.weight", ".gate_proj.weight")
            .replace(".w3.weight", ".up_proj.weight")
            .replace(".w2.weight", ".down_proj.weight");
    }
    n
}

/// Whether a fused tensor has elements and exactly its shape's bytes (so
/// its expert count bounds the work of splitting it).
fn holds_its_shape(t: &Tensor) -> bool {
    let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    n.and_then(|n| n.checked_mul(t.dtype.bytes())).is_some_and(|b| b > 0 && b == t.data.len())
}

/// The per-expert tensors of a fused expert tensor, as transformers 5 holds
/// them (`mlp.experts.gate_up_proj` `[E, 2I, H]`, gate rows first;
/// `mlp.experts.down_proj` `[E, H, I]`); `None` for any other tensor.
fn unfuse(name: &str, t: &Tensor) -> Result<Option<Vec<(String, Tensor)>>, WeightsError> {
    let (pre, parts, what): (&str, &[&str], &'static str) =
        if let Some(p) = name.strip_suffix(".mlp.experts.gate_up_proj") {
            (p, &["gate_proj", "up_proj"], "2 × intermediate (gate rows, then up)")
        } else if let Some(p) = name.strip_suffix(".mlp.experts.down_proj") {
            (p, &["down_proj"], "hidden")
        } else {
            return Ok(None);
        };
    let bad = || WeightsError::Fused { name: name.to_string(), found: t.shape.clone(), rows: what };
    if !holds_its_shape(t) {
        return Err(bad());
    }
    let &[e, rows, cols] = t.shape.as_slice() else { return Err(bad()) };
    if rows % parts.len() != 0 {
        return Err(bad());
    }
    let r = rows / parts.len();
    let elem = t.dtype.bytes();
    let mut out = Vec::new();
    for x in 0..e {
        for (i, part) in parts.iter().enumerate() {
            // Each expert's part is contiguous: a range of the fused tensor's bytes.
            let at = (x * rows + i * r) * cols * elem;
            let data = t.data.sub(at, r * cols * elem).ok_or_else(bad)?;
            out.push((
                format!("{pre}.mlp.experts.{x}.{part}.weight"),
                Tensor { shape: vec![r, cols], dtype: t.dtype, data },
            ));
        }
    }
    Ok(Some(out))
}

/// GPT-OSS's fused experts as its checkpoints hold them (transformers'
/// `GptOssExperts`): `mlp.experts.gate_up_proj` `[E, H, 2I]` with gate and up
/// interleaved along the last dimension (gate at even columns), its bias
/// `[E, 2I]` interleaved alike, `mlp.experts.down_proj` `[E, I, H]` and its
/// bias `[E, H]`; as per-expert `[I, H]` gate and up, `[H, I]` down and
/// their biases. `None` for any other tensor.
fn unfuse_gpt_oss(name: &str, t: &Tensor) -> Result<Option<Vec<(String, Tensor)>>, WeightsError> {
    let sfx = [
        ".mlp.experts.gate_up_proj",
        ".mlp.experts.gate_up_proj_bias",
        ".mlp.experts.down_proj",
        ".mlp.experts.down_proj_bias",
    ];
    let Some((k, pre)) = sfx.iter().enumerate().find_map(|(k, s)| name.strip_suffix(s).map(|p| (k, p))) else {
        return Ok(None);
    };
    let what = [
        "[experts, hidden, 2 × intermediate]",
        "[experts, 2 × intermediate]",
        "[experts, intermediate, hidden]",
        "[experts, hidden]",
    ][k];
    let bad = || WeightsError::Fused { name: name.to_string(), found: t.shape.clone(), rows: what };
    if t.dtype != Dtype::Bf16 {
        return Err(WeightsError::Dtype { name: name.to_string(), dtype: t.dtype.name().into(), expected: "bf16" });
    }
    if !holds_its_shape(t) {
        return Err(bad());
    }
    let at = |i: usize| -> Result<[u8; 2], WeightsError> {
        t.data.get(2 * i..2 * i + 2).map(|b| [b[0], b[1]]).ok_or_else(bad)
    };
    let mut out = Vec::new();
    let tensor = |shape: Vec<usize>, data: Vec<u8>| Tensor { shape, dtype: Dtype::Bf16, data: data.into() };
    match (k, t.shape.as_slice()) {
        (0, &[e, h, i2]) if i2 % 2 == 0 => {
            for x in 0..e {
                for (c, part) in ["gate_proj", "up_proj"].iter().enumerate() {
                    // Row j of the [I, H] matrix: column 2j + c of the expert's [H, 2I].
                    let mut data = Vec::with_capacity(i2 / 2 * h * 2);
                    for j in 0..i2 / 2 {
                        for r in 0..h {
                            data.extend(at((x * h + r) * i2 + 2 * j + c)?);
                        }
                    }
                    out.push((format!("{pre}.mlp.experts.{x}.{part}.weight"), tensor(vec![i2 / 2, h], data)));
                }
            }
        }
        (1, &[e, i2]) if i2 % 2 == 0 => {
            for x in 0..e {
                for (c, part) in ["gate_proj", "up_proj"].iter().enumerate() {
                    let data = (0..i2 / 2).map(|j| at(x * i2 + 2 * j + c)).collect::<Result<Vec<_>, _>>()?.concat();
                    out.push((format!("{pre}.mlp.experts.{x}.{part}.bias"), tensor(vec![i2 / 2], data)));
                }
            }
        }
        (2, &[e, i, h]) => {
            for x in 0..e {
                let mut data = Vec::with_capacity(h * i * 2);
                for r in 0..h {
                    for c in 0..i {
                        data.extend(at((x * i + c) * h + r)?);
                    }
                }
                out.push((format!("{pre}.mlp.experts.{x}.down_proj.weight"), tensor(vec![h, i], data)));
            }
        }
        (3, &[e, h]) => {
            for x in 0..e {
                let data = t.data.get(2 * x * h..2 * (x + 1) * h).ok_or_else(bad)?.to_vec();
                out.push((format!("{pre}.mlp.experts.{x}.down_proj.bias"), tensor(vec![h], data)));
            }
        }
        _ => return Err(bad()),
    }
    Ok(Some(out))
}

fn family_name(canonical: &str, family: Family) -> String {
    match family {
        Family::Qwen3Moe => canonical.to_string(),
        Family::Mixtral => canonical
            .replace(".mlp.gate.", ".block_sparse_moe.gate.")
            .replace(".mlp.experts.", ".block_sparse_moe.experts.")
            .replace(".gate_proj.weight", ".w1.weight")
            .replace(".up_proj.weight", ".w3.weight")
            .replace(".down_proj.weight", ".w2.weight"),
    }
}

impl Checkpoint {
    /// Loads every `*.safetensors` file in `dir`, each read into memory once.
    pub fn load(dir: &Path) -> Result<Checkpoint, WeightsError> {
        Checkpoint::load_with(dir, &read_file)
    }

    /// Loads every `*.safetensors` file in `dir` opened by `open`: a tensor
    /// kept as stored is a range of its file's bytes, never a copy.
    pub fn load_with(dir: &Path, open: OpenFile<'_>) -> Result<Checkpoint, WeightsError> {
        let io = |e: std::io::Error| WeightsError::Io { path: dir.display().to_string(), err: e.to_string() };
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(WeightsError::Empty(dir.display().to_string()));
        }
        let mut out = Checkpoint::default();
        // GPT-OSS holds its experts fused in its own layout (config.json's model_type says so).
        let gpt_oss = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|c| serde_json::from_str::<serde_json::Value>(&c).ok())
            .is_some_and(|c| c.get("model_type").and_then(|m| m.as_str()) == Some("gpt_oss"));
        for f in files {
            let path = f.display().to_string();
            let file = open(&f).map_err(|e| WeightsError::Io { path: path.clone(), err: e.to_string() })?;
            let whole: &[u8] = (*file).as_ref();
            let st = safetensors::SafeTensors::deserialize(whole)
                .map_err(|e| WeightsError::Format { path: path.clone(), err: e.to_string() })?;
            for (name, view) in st.tensors() {
                let dtype = match view.dtype() {
                    safetensors::Dtype::BF16 => Dtype::Bf16,
                    safetensors::Dtype::F32 => Dtype::F32,
                    safetensors::Dtype::F8_E4M3 => Dtype::F8E4m3,
                    other => {
                        return Err(WeightsError::Dtype {
                            name,
                            dtype: format!("{other:?}"),
                            expected: "bf16, f32 or fp8 e4m3",
                        })
                    }
                };
                let canon = canonical(&name);
                // Where the tensor's bytes lie in the file (safetensors hands
                // out a slice of the buffer it was given).
                let at = (view.data().as_ptr() as usize).wrapping_sub(whole.as_ptr() as usize);
                let data = Bytes::in_file(&file, at, view.data().len())
                    .filter(|b| b.as_ptr() == view.data().as_ptr())
                    .unwrap_or_else(|| view.data().to_vec().into());
                let mut t = Tensor { shape: view.shape().to_vec(), dtype, data };
                // The selection bias and block scales are computed in f32; a
                // bf16 bias widens exactly. Other f32 tensors become the bf16
                // the views hold.
                let f32_kept = canon.ends_with("e_score_correction_bias") || canon.ends_with("_scale_inv");
                if f32_kept && t.dtype == Dtype::Bf16 {
                    t.data = bf16s(&t.data, 0, t.data.len() / 2).flat_map(f32::to_le_bytes).collect::<Vec<u8>>().into();
                    t.dtype = Dtype::F32;
                } else if !f32_kept && t.dtype == Dtype::F32 {
                    let (data, exact) = narrow(&t.data);
                    if !exact {
                        out.rounded.push(canon.clone());
                    }
                    t = Tensor { data: data.into(), dtype: Dtype::Bf16, ..t };
                }
                let parts = if gpt_oss { unfuse_gpt_oss(&canon, &t)? } else { unfuse(&canon, &t)? };
                match parts {
                    Some(parts) => out.tensors.extend(parts),
                    None => {
                        out.tensors.insert(canon, t);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The tensor `name` with the expected shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&Tensor, WeightsError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::Missing { name: name.to_string(), shape: shape.to_vec() })?;
        if t.shape != shape {
            return Err(WeightsError::Shape {
                name: name.to_string(),
                found: t.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// Checks that every tensor the model needs is present with its shape and
    /// dtype (bf16; fp8 e4m3 where the model stores fp8, with f32 block
    /// scales; the selection bias f32).
    pub fn validate(&self, m: &TwinModel) -> Result<(), WeightsError> {
        let needed = m.tensor_shapes();
        for (name, shape) in &needed {
            let t = self.get(name, shape)?;
            let want = if name.ends_with("e_score_correction_bias") || name.ends_with("_scale_inv") {
                Dtype::F32
            } else if m.fp8_tensor(name) {
                Dtype::F8E4m3
            } else {
                Dtype::Bf16
            };
            if t.dtype != want {
                return Err(WeightsError::Dtype {
                    name: name.clone(),
                    dtype: t.dtype.name().into(),
                    expected: want.name(),
                });
            }
        }
        // A bias the model does not read would change every number silently.
        if let Some(name) = self.tensors.keys().find(|n| n.ends_with(".bias") && !needed.iter().any(|(x, _)| x == *n)) {
            return Err(WeightsError::Unused { name: name.clone(), why: "the spec has no projection biases" });
        }
        Ok(())
    }
}

/// f32 little-endian values as bf16 (round to nearest even); whether every
/// value was exact.
fn narrow(f32_bytes: &[u8]) -> (Vec<u8>, bool) {
    let mut exact = true;
    let data = f32_bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let b = f32_to_bf16(v);
            exact &= crate::reference::bf16_to_f32(b).to_bits() == v.to_bits();
            b.to_le_bytes()
        })
        .collect();
    (data, exact)
}

/// The e4m3 code nearest `x` (ties to the even code), saturating at ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // Positive codes 0..=0x7e are increasing in value.
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    if a >= e4m3_to_f32(hi) {
        return sign | hi;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    sign | if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi }
}

/// A `[rows, cols]` matrix as e4m3 codes with one f32 scale per
/// `block × block` block (its largest magnitude over 448, e4m3's largest),
/// as DeepSeek-V3's checkpoints store weights: w ≈ code × scale.
pub fn quantize_e4m3(w: &[f32], rows: usize, cols: usize, block: usize) -> (Vec<u8>, Vec<f32>) {
    let b = block.max(1);
    let (br, bc) = (rows.div_ceil(b), cols.div_ceil(b));
    let mut scales = vec![0f32; br * bc];
    for (i, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = (i / bc * b, i % bc * b);
        let amax = (r0..(r0 + b).min(rows))
            .flat_map(|r| (c0..(c0 + b).min(cols)).map(move |c| w[r * cols + c].abs()))
            .fold(0f32, f32::max);
        *s = (amax / 448.0).max(1e-12);
    }
    let codes = (0..rows * cols).map(|at| f32_to_e4m3(w[at] / scales[(at / cols / b) * bc + at % cols / b])).collect();
    (codes, scales)
}

/// Writes a random bf16 checkpoint for `m` to `dir/model.safetensors`
/// (scaled like a trained model: 1/√fan_in weights, unit norms).
/// Refuses models past [`MAX_RANDOM_PARAMS`] before allocating anything, and
/// writes the file under a temporary name renamed into place, so a failure
/// (a full disk) leaves no partial checkpoint (nor a directory it created).
pub fn write_random(m: &TwinModel, seed: u64, family: Family, dir: &Path) -> Result<(), WeightsError> {
    let params = m
        .tensor_shapes()
        .iter()
        .map(|(_, s)| s.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64)))
        .try_fold(0u64, |a, n| a.checked_add(n?))
        .unwrap_or(u64::MAX);
    if params > MAX_RANDOM_PARAMS {
        return Err(WeightsError::TooLarge { params, gb: params as f64 * 2.0 / 1e9, limit: MAX_RANDOM_PARAMS });
    }
    let io = |e: std::io::Error| WeightsError::Io { path: dir.display().to_string(), err: e.to_string() };
    // The outermost directory this call creates, removed again on failure.
    let created =
        dir.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).last().map(Path::to_path_buf);
    std::fs::create_dir_all(dir).map_err(io)?;
    let written = write_random_into(m, seed, family, dir);
    if let (Err(_), Some(c)) = (&written, &created) {
        let _ = std::fs::remove_dir_all(c);
    }
    written
}

fn write_random_into(m: &TwinModel, seed: u64, family: Family, dir: &Path) -> Result<(), WeightsError> {
    let mut rng = moeforge_plan::rng::SplitMix64(seed ^ 0x6d6f_6566_6f72_6765);
    let mut next = move || rng.signed_unit();
    let mut tensors: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    let mut scales: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (name, shape) in m.tensor_shapes() {
        if let Some(data) = scales.remove(&name) {
            tensors.push((family_name(&name, family), shape, Dtype::F32, data));
            continue;
        }
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            (0..n).map(|_| 1.0 + 0.1 * next()).collect()
        } else if name.contains("embed_tokens") {
            (0..n).map(|_| next()).collect()
        } else {
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            let scale = 1.0 / fan_in.sqrt();
            (0..n).map(|_| next() * scale).collect()
        };
        let (dtype, data) = if name.ends_with("e_score_correction_bias") {
            (Dtype::F32, values.iter().flat_map(|v| (v * 0.1).to_le_bytes()).collect())
        } else if m.fp8_tensor(&name) {
            // Block-quantized as the Hub's fp8 checkpoints are; the scales come next.
            let (codes, s) = quantize_e4m3(&values, shape[0], shape[1], m.scale_block);
            scales.insert(format!("{name}_scale_inv"), s.iter().flat_map(|v| v.to_le_bytes()).collect());
            (Dtype::F8E4m3, codes)
        } else {
            (Dtype::Bf16, values.iter().flat_map(|v| f32_to_bf16(*v).to_le_bytes()).collect())
        };
        tensors.push((family_name(&name, family), shape, dtype, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, t, d)| {
            let dtype = match t {
                Dtype::F32 => safetensors::Dtype::F32,
                Dtype::Bf16 => safetensors::Dtype::BF16,
                Dtype::F8E4m3 => safetensors::Dtype::F8_E4M3,
            };
            safetensors::tensor::TensorView::new(dtype, s.clone(), d)
                .map(|v| (n.clone(), v))
                .map_err(|e| WeightsError::Format { path: n.clone(), err: e.to_string() })
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join("model.safetensors");
    let tmp = dir.join(".model.safetensors.partial");
    let fail = |e: String| {
        let _ = std::fs::remove_file(&tmp);
        WeightsError::Io { path: path.display().to_string(), err: e }
    };
    safetensors::serialize_to_file(views, &None, &tmp).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&tmp, &path).map_err(|e| fail(e.to_string()))
}
