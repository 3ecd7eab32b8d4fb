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

use super::math::bf16s;
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

/// A tensor: shape, whether it is f32 (else bf16), little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub f32: bool,
    pub data: Vec<u8>,
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
    #[error("{name}: dtype {dtype}, but the CPU twin loads bf16 (and f32 bias) checkpoints")]
    Dtype { name: String, dtype: String },
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
}

/// Canonical name of a checkpoint tensor name.
pub fn canonical(name: &str) -> String {
    let n = name
        .replace(".block_sparse_moe.", ".mlp.")
        .replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias");
    if n.contains(".mlp.experts.") {
        return n
            .replace(".w1.weight", ".gate_proj.weight")
            .replace(".w3.weight", ".up_proj.weight")
            .replace(".w2.weight", ".down_proj.weight");
    }
    n
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
    let &[e, rows, cols] = t.shape.as_slice() else { return Err(bad()) };
    if rows % parts.len() != 0 {
        return Err(bad());
    }
    let r = rows / parts.len();
    let elem = if t.f32 { 4 } else { 2 };
    let mut out = Vec::with_capacity(e * parts.len());
    for x in 0..e {
        for (i, part) in parts.iter().enumerate() {
            let at = (x * rows + i * r) * cols * elem;
            let data = t.data.get(at..at + r * cols * elem).ok_or_else(bad)?.to_vec();
            out.push((
                format!("{pre}.mlp.experts.{x}.{part}.weight"),
                Tensor { shape: vec![r, cols], f32: t.f32, data },
            ));
        }
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
    /// Loads every `*.safetensors` file in `dir`.
    pub fn load(dir: &Path) -> Result<Checkpoint, WeightsError> {
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
        for f in files {
            let path = f.display().to_string();
            let bytes = std::fs::read(&f).map_err(|e| WeightsError::Io { path: path.clone(), err: e.to_string() })?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| WeightsError::Format { path: path.clone(), err: e.to_string() })?;
            for (name, view) in st.tensors() {
                let f32 = match view.dtype() {
                    safetensors::Dtype::BF16 => false,
                    safetensors::Dtype::F32 => true,
                    other => return Err(WeightsError::Dtype { name, dtype: format!("{other:?}") }),
                };
                let canon = canonical(&name);
                let mut t = Tensor { shape: view.shape().to_vec(), f32, data: view.data().to_vec() };
                // The selection bias is computed in f32; a bf16 copy widens exactly.
                let bias = canon.ends_with("e_score_correction_bias");
                if bias && !t.f32 {
                    t.data = bf16s(&t.data, 0, t.data.len() / 2).flat_map(f32::to_le_bytes).collect();
                    t.f32 = true;
                } else if !bias && t.f32 {
                    let (data, exact) = narrow(&t.data);
                    if !exact {
                        out.rounded.push(canon.clone());
                    }
                    t = Tensor { data, f32: false, ..t };
                }
                match unfuse(&canon, &t)? {
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
    /// dtype (bf16; the selection bias f32).
    pub fn validate(&self, m: &TwinModel) -> Result<(), WeightsError> {
        let needed = m.tensor_shapes();
        for (name, shape) in &needed {
            let t = self.get(name, shape)?;
            let want_f32 = name.ends_with("e_score_correction_bias");
            if t.f32 != want_f32 {
                let dtype = if t.f32 { "F32" } else { "BF16" };
                return Err(WeightsError::Dtype { name: name.clone(), dtype: dtype.into() });
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

/// Writes a random bf16 checkpoint for `m` to `dir/model.safetensors`
/// (scaled like a trained model: 1/√fan_in weights, unit norms).
pub fn write_random(m: &TwinModel, seed: u64, family: Family, dir: &Path) -> Result<(), WeightsError> {
    let io = |e: std::io::Error| WeightsError::Io { path: dir.display().to_string(), err: e.to_string() };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut rng = moeforge_plan::rng::SplitMix64(seed ^ 0x6d6f_6566_6f72_6765);
    let mut next = move || rng.signed_unit();
    let mut tensors: Vec<(String, Vec<usize>, bool, Vec<u8>)> = Vec::new();
    for (name, shape) in m.tensor_shapes() {
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
        let f32 = name.ends_with("e_score_correction_bias");
        let data: Vec<u8> = if f32 {
            values.iter().flat_map(|v| (v * 0.1).to_le_bytes()).collect()
        } else {
            values.iter().flat_map(|v| f32_to_bf16(*v).to_le_bytes()).collect()
        };
        tensors.push((family_name(&name, family), shape, f32, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, f, d)| {
            let dtype = if *f { safetensors::Dtype::F32 } else { safetensors::Dtype::BF16 };
            safetensors::tensor::TensorView::new(dtype, s.clone(), d)
                .map(|v| (n.clone(), v))
                .map_err(|e| WeightsError::Format { path: n.clone(), err: e.to_string() })
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, &None, &path)
        .map_err(|e| WeightsError::Io { path: path.display().to_string(), err: e.to_string() })
}
