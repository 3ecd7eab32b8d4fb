//! Loading a checkpoint into the ranks' unified buffers (the host twin's,
//! or straight into an attached device's), through the views:
//! each view's bytes are the slice of the checkpoint tensor its shard says
//! (whole tensors, head rows or columns, local experts, or every expert's
//! `1/P` of the intermediate dimension).

use super::weights::{Checkpoint, Tensor};
use super::{Twin, TwinError, TwinModel};
use moeforge_plan::memory::{head_block, HeadSet, Mode, Shard, TensorPart, TensorRole, View};

impl Twin {
    /// Writes every tensor into the views that hold it: replicated and both
    /// attention layouts in every plan mode, experts in the current mode; on
    /// the attached device when there is one, else in the host buffers.
    pub(super) fn load(&mut self, ck: &Checkpoint) -> Result<(), TwinError> {
        let m = self.model.clone();
        let p = self.ranks.len();
        let views: Vec<View> =
            self.views.values().chain(self.scales.values()).chain(self.biases.values()).cloned().collect();
        for v in &views {
            // TP views of full attention tensors alias the EP copy: written once.
            let aliased = self
                .views
                .get(&(Mode::Ep, v.role))
                .is_some_and(|e| e.offset == v.offset && e.layer_stride == v.layer_stride);
            if v.mode == Mode::Tp && v.shard == Shard::Full && aliased {
                continue;
            }
            if v.role.is_routed_expert() && v.mode != self.mode {
                continue;
            }
            for l in v.layers[0]..v.layers[1] {
                let name = v.tensor.replace("{l}", &l.to_string());
                for r in 0..p {
                    // A role plan's GPU holds only its role's regions.
                    let role = self.ranks[r].role;
                    if !self.plan.regions.get(v.region.index()).is_some_and(|g| g.held_by(role)) {
                        continue;
                    }
                    let bytes = self.slice_for(ck, &m, v, &name, l as usize, r)?;
                    if bytes.len() as u64 != v.bytes() {
                        return Err(TwinError::Unsupported(format!(
                            "`{name}` is {} bytes in the checkpoint's layout but its {} view holds {}",
                            bytes.len(),
                            v.mode.name(),
                            v.bytes()
                        )));
                    }
                    let at = v.offset_of(l);
                    match self.device.as_mut() {
                        Some(dev) => dev
                            .upload(r, at, &bytes)
                            .map_err(|e| TwinError::Unsupported(format!("uploading `{name}` to rank {r}: {e}")))?,
                        None => {
                            let at = at as usize;
                            let out = self.ranks[r].buf.get_mut(at..at + bytes.len()).ok_or_else(|| {
                                TwinError::Unsupported(format!("`{name}`'s view lies outside rank {r}'s buffer"))
                            })?;
                            out.copy_from_slice(&bytes);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The bytes view `v` holds on rank `r` for layer `l`.
    fn slice_for(
        &self,
        ck: &Checkpoint,
        m: &TwinModel,
        v: &View,
        name: &str,
        l: usize,
        r: usize,
    ) -> Result<Vec<u8>, TwinError> {
        let p = self.ranks.len();
        let short = |t: &str| TwinError::Unsupported(format!("`{t}` is smaller than its view's shard of it"));
        let rows = |t: &Tensor, a: usize, b: usize| -> Result<Vec<u8>, TwinError> {
            let w = t.shape.get(1).copied().unwrap_or(1) * t.dtype.bytes();
            t.data.get(a * w..b * w).map(<[u8]>::to_vec).ok_or_else(|| short(name))
        };
        let scale = v.part == TensorPart::ScaleInv;
        if v.part == TensorPart::Bias {
            return self.bias_for(ck, m, v, name, l, r);
        }
        Ok(match v.shard {
            // The indexer key's LayerNorm: one view of two rows, the checkpoint's weight and bias.
            Shard::Full if v.role == TensorRole::IndexerKNorm => {
                let d = v.shape.get(1).copied().unwrap_or(0) as usize;
                let mut out = ck.get(name, &[d])?.data.to_vec();
                out.extend_from_slice(&ck.get(&name.replace(".weight", ".bias"), &[d])?.data);
                out
            }
            Shard::Full => {
                let shape: Vec<usize> = v.shape.iter().map(|&x| x as usize).collect();
                ck.get(name, &shape)?.data.to_vec()
            }
            Shard::Heads { .. } if scale || m.fp8(v.role) => {
                return Err(TwinError::Unsupported(format!(
                    "`{name}`: the CPU twin does not shard fp8 weights and their block scales by heads (TP)"
                )))
            }
            Shard::Heads { dim, heads } => {
                let hd = m.head_rows(v.role);
                let [a, b] = match heads {
                    HeadSet::Query => head_block(m.heads as u32, p as u32, r as u32),
                    HeadSet::Kv => self.plan.kv.tp_heads.get(r).copied().unwrap_or([0, 0]),
                };
                let (a, b) = (a as usize * hd, b as usize * hd);
                let full_shape = m.full_shape(v.role);
                let t = ck.get(name, &full_shape)?;
                if dim == 0 {
                    rows(t, a, b)?
                } else {
                    let cols = full_shape[1];
                    let mut out = Vec::with_capacity(full_shape[0] * (b - a) * 2);
                    for row in 0..full_shape[0] {
                        let cells =
                            t.data.get(2 * (row * cols + a)..2 * (row * cols + b)).ok_or_else(|| short(name))?;
                        out.extend_from_slice(cells);
                    }
                    out
                }
            }
            Shard::ExpertShard { .. } if scale || m.fp8(v.role) => {
                return Err(TwinError::Unsupported(format!(
                    "`{name}`: the CPU twin does not slice fp8 experts' intermediate dimension (TP)"
                )))
            }
            Shard::LocalExperts if scale => {
                let (i, h) = (m.expert_ffn, m.hidden);
                let layer_pre = format!("model.layers.{l}.mlp.experts");
                let parts: &[(&str, [usize; 2])] = if v.role == TensorRole::ExpertsW13 {
                    &[("gate_proj", [i, h]), ("up_proj", [i, h])]
                } else {
                    &[("down_proj", [h, i])]
                };
                let mut out = Vec::with_capacity(v.bytes() as usize);
                for &g in self.slots.experts(l, r) {
                    for &(part, [rows, cols]) in parts {
                        let shape = m.scale_shape(rows, cols);
                        out.extend_from_slice(
                            &ck.get(&format!("{layer_pre}.{g}.{part}.weight_scale_inv"), &shape)?.data,
                        );
                    }
                }
                out
            }
            Shard::LocalExperts | Shard::ExpertShard { .. } => {
                let (e, i, h) = (m.experts, m.expert_ffn, m.hidden);
                let layer_pre = format!("model.layers.{l}.mlp.experts");
                let w13 = v.role == TensorRole::ExpertsW13;
                let elem = if m.fp8(v.role) { 1 } else { 2 };
                let mut out = Vec::with_capacity(v.bytes() as usize);
                let (experts, slice): (Vec<usize>, (usize, usize)) = match v.shard {
                    Shard::LocalExperts => (self.slots.experts(l, r).iter().map(|&g| g as usize).collect(), (0, i)),
                    _ => ((0..e).collect(), (r * i / p, (r + 1) * i / p)),
                };
                for g in experts {
                    if w13 {
                        for part in ["gate_proj", "up_proj"] {
                            let t = ck.get(&format!("{layer_pre}.{g}.{part}.weight"), &[i, h])?;
                            out.extend(rows(t, slice.0, slice.1)?);
                        }
                    } else {
                        let t = ck.get(&format!("{layer_pre}.{g}.down_proj.weight"), &[h, i])?;
                        for row in 0..h {
                            let cells = t
                                .data
                                .get(elem * (row * i + slice.0)..elem * (row * i + slice.1))
                                .ok_or_else(|| short(name))?;
                            out.extend_from_slice(cells);
                        }
                    }
                }
                out
            }
        })
    }

    /// The bias view `v` holds on rank `r` for layer `l`: a projection's
    /// (its heads' rows in TP), the router's, or the local experts' gate‖up
    /// and down biases.
    fn bias_for(
        &self,
        ck: &Checkpoint,
        m: &TwinModel,
        v: &View,
        name: &str,
        l: usize,
        r: usize,
    ) -> Result<Vec<u8>, TwinError> {
        let p = self.ranks.len();
        let short = || TwinError::Unsupported(format!("`{name}` is smaller than its view's shard of it"));
        Ok(match v.shard {
            Shard::Full => ck.get(name, &[v.shape.iter().product::<u64>() as usize])?.data.to_vec(),
            Shard::Heads { heads, .. } => {
                let hd = m.head_rows(v.role);
                let [a, b] = match heads {
                    HeadSet::Query => head_block(m.heads as u32, p as u32, r as u32),
                    HeadSet::Kv => self.plan.kv.tp_heads.get(r).copied().unwrap_or([0, 0]),
                };
                let t = ck.get(name, &[m.full_shape(v.role)[0]])?;
                t.data.get(2 * a as usize * hd..2 * b as usize * hd).map(<[u8]>::to_vec).ok_or_else(short)?
            }
            Shard::LocalExperts => {
                let (i, h) = (m.expert_ffn, m.hidden);
                let pre = format!("model.layers.{l}.mlp.experts");
                let parts: &[(&str, usize)] = if v.role == TensorRole::ExpertsW13 {
                    &[("gate_proj", i), ("up_proj", i)]
                } else {
                    &[("down_proj", h)]
                };
                let mut out = Vec::with_capacity(v.bytes() as usize);
                for &g in self.slots.experts(l, r) {
                    for &(part, n) in parts {
                        out.extend_from_slice(&ck.get(&format!("{pre}.{g}.{part}.bias"), &[n])?.data);
                    }
                }
                out
            }
            Shard::ExpertShard { .. } => {
                return Err(TwinError::Unsupported(format!(
                    "`{name}`: the CPU twin does not slice experts' biases (TP); the plan holds them in EP only"
                )))
            }
        })
    }
}
