//! The calibrated constants of the cost model, each from a published
//! measurement (or marked *assumed* where no published figure exists), in one
//! value the cost model carries, the simulator reads and
//! `moeforge simulate --sensitivity` perturbs.
//!
//! Sources (all H800 unless stated):
//! - DeepGEMM README (Feb 2025, NVCC 12.8): contiguous grouped GEMMs (prefill
//!   layout) reach 1093–1297 TFLOP/s of the 1979 TFLOP/s fp8 peak (1346 is
//!   the best figure quoted for DeepGEMM elsewhere); dense
//!   M = 64 GEMMs, memory-bound, move 1688–2668 GB/s (median 2388) of 3350.
//! - DeepEP README (V1): intranode EP8 normal kernels 153 GB/s dispatch and
//!   158 GB/s combine over NVLink (H800: 200 GB/s per direction); internode
//!   EP16 43 GB/s per 50 GB/s CX7 NIC; low-latency kernels (128 tokens, 7168
//!   wide, top-8) 77–194 µs dispatch and 114–369 µs combine over EP8–EP256.
//! - model-zoo.md: the H200 here copies device-to-device at 4.3 of 4.8 TB/s.
//! - ExpertPlex Fig. 12: under Green Context and MPS a decode GEMM beside a
//!   prefill GEMM slows 1.24× and 1.34× while the prefill slows 4.07× and 3.33×.

use serde::{Deserialize, Serialize};

/// The constants; [`Calibration::published`] is the cited set.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Fraction of dense tensor-core peak a compute-bound grouped GEMM tile
    /// reaches: DeepGEMM contiguous grouped 1093–1346 of 1979 TFLOP/s (0.55–0.68);
    /// 1320 (0.667) sits in the upper part of that span.
    pub compute_efficiency: f64,
    /// Fraction of HBM bandwidth a memory-bound GEMM streams its weights at:
    /// ExpertPlex §4.1's MiniMax-M2 decode GateUp (eight experts' 2·3072·1536
    /// fp8 weights in 34.7 µs on H800: 2176 of 3350 GB/s, 0.650), the grouped
    /// decode GEMM the model charges, measured in the setting it is pinned
    /// to; inside DeepGEMM's dense M = 64 span (1688–2668 GB/s, median 2388),
    /// which is not grouped. The same figure's Down GEMM is pinned in
    /// `tests/anchors.rs`.
    pub gemm_memory_efficiency: f64,
    /// Fraction of HBM bandwidth streaming reads and copies (KV, activations)
    /// reach: 4.3 of 4.8 TB/s measured on the H200 here (model-zoo.md).
    pub stream_memory_efficiency: f64,
    /// Fraction of per-direction NVLink bandwidth dispatch and combine reach:
    /// DeepEP intranode EP8 153 (dispatch) / 158 (combine) GB/s of H800's 200.
    pub nvlink_efficiency: f64,
    /// Fraction of a NIC's line rate cross-node dispatch and combine reach:
    /// DeepEP internode EP16 43 GB/s of a 50 GB/s (400 Gb/s) CX7.
    pub rdma_efficiency: f64,
    /// Fixed cost of one dispatch or combine kernel (launch, signalling,
    /// completion). DeepEP's low-latency table is, from EP16 to EP256, its
    /// remote bytes at `rdma_efficiency` plus a constant: 194 µs at EP256
    /// less 7.3 MB at 43 GB/s leaves 24 µs. The constant does not grow with
    /// the number of destinations (EP16: 118 − 88 = 30 µs, EP128: 192 − 165 = 27).
    pub comm_floor: f64,
    /// Host round trip of a normal-mode (receiver-count) dispatch: DeepEP's
    /// normal kernels make the CPU wait for the received counts before
    /// allocating (its README), once per MoE layer of a prefill step.
    /// *Assumed* (no published latency): one device→host→device round trip.
    pub normal_mode_sync: f64,
    /// Fixed cost of one kernel under CUDA graphs (launch gap, tail wave).
    /// *Assumed*.
    pub op_overhead: f64,
    /// Host time to launch one layer's kernels outside a CUDA graph (PyTorch
    /// eager): iterations that carry prompt tokens run eagerly in SGLang
    /// (graphs are captured for decode batches only), so such a step takes
    /// at least its layers × this. From Moebius Fig. 12: eager decode is up
    /// to 6.95× a graph step at low batch; this model's Qwen3-235B TP8 graph
    /// step at batch 1 on H200 is 13.9 ms over 94 layers: 6.95 × 13.9 / 94 ≈ 1.0 ms.
    pub eager_layer: f64,
    /// Fixed cost of one serving iteration outside the forward pass:
    /// scheduling, sampling, the DP batch-size sync and the graph launch.
    /// *Assumed*; SGLang's overlap scheduler hides most of the CPU work.
    pub iteration_overhead: f64,
    /// Fraction of the SMs a memory-bound grouped GEMM needs to reach its
    /// full HBM bandwidth; with fewer, each SM streams its own share
    /// (outstanding loads per SM bound the bandwidth), so the weight and
    /// activation streams slow by this / (SMs held / SMs). From ExpertPlex
    /// Fig. 12 (GLM-5 decode GEMM beside a prefill GEMM): Green Context
    /// slows the compute-bound prefill GEMM 4.07×, so prefill held 1/4.07
    /// of the SMs and decode 0.754, and the decode GEMM 1.24×:
    /// 1.24 × 0.754 = 0.935.
    #[serde(default = "default_stream_sm_saturation")]
    pub stream_sm_saturation: f64,
}

fn default_stream_sm_saturation() -> f64 {
    Calibration::published().stream_sm_saturation
}

impl Default for Calibration {
    fn default() -> Calibration {
        Calibration::published()
    }
}

impl Calibration {
    /// The cited constants.
    pub const fn published() -> Calibration {
        Calibration {
            compute_efficiency: 1320.0 / 1979.0,
            gemm_memory_efficiency: 2.0 * 3072.0 * 1536.0 * 8.0 / 34.7e-6 / 3350e9,
            stream_memory_efficiency: 4.3 / 4.8,
            nvlink_efficiency: 153.0 / 200.0,
            rdma_efficiency: 43.0 / 50.0,
            comm_floor: 24e-6,
            normal_mode_sync: 20e-6,
            op_overhead: 5e-6,
            eager_layer: 1.0e-3,
            iteration_overhead: 1e-3,
            stream_sm_saturation: 1.24 * (1.0 - 1.0 / 4.07),
        }
    }

    /// Every constant by name, with its value and where it comes from.
    pub fn entries(&self) -> [(&'static str, f64, &'static str); 11] {
        [
            (
                "compute_efficiency",
                self.compute_efficiency,
                "DeepGEMM contiguous grouped GEMM, 1093–1346 of 1979 TFLOP/s",
            ),
            (
                "gemm_memory_efficiency",
                self.gemm_memory_efficiency,
                "ExpertPlex §4.1: MiniMax-M2 EP4 decode GateUp, 8 experts in 34.7 µs (2176 of 3350 GB/s)",
            ),
            (
                "stream_memory_efficiency",
                self.stream_memory_efficiency,
                "H200 device copy, 4.3 of 4.8 TB/s (model-zoo.md)",
            ),
            ("nvlink_efficiency", self.nvlink_efficiency, "DeepEP intranode EP8, 153 of 200 GB/s"),
            ("rdma_efficiency", self.rdma_efficiency, "DeepEP internode EP16, 43 of 50 GB/s"),
            ("comm_floor", self.comm_floor, "DeepEP low-latency EP256 dispatch less its bytes"),
            ("normal_mode_sync", self.normal_mode_sync, "assumed: one host round trip per normal-mode dispatch"),
            ("op_overhead", self.op_overhead, "assumed: one kernel under CUDA graphs"),
            ("eager_layer", self.eager_layer, "Moebius Fig. 12: eager decode 6.95× a graph step at low batch"),
            ("iteration_overhead", self.iteration_overhead, "assumed: scheduling, sampling, DP sync per step"),
            (
                "stream_sm_saturation",
                self.stream_sm_saturation,
                "ExpertPlex Fig. 12: Green Context's decode GEMM 1.24× on the 0.754 of SMs prefill's 4.07× leaves",
            ),
        ]
    }

    /// Where the published measurements put a constant (lowest, highest),
    /// for the sensitivity report's "holds at / breaks at ×f" lines; `None`
    /// for an *assumed* constant (nothing published bounds it).
    pub fn published_range(name: &str) -> Option<(f64, f64)> {
        Some(match name {
            // DeepGEMM's contiguous grouped GEMMs: the README's rows (H800,
            // NVCC 12.8) run 1093–1297 TFLOP/s; 1346 is the best figure
            // quoted for it elsewhere; of 1979.
            "compute_efficiency" => (1093.0 / 1979.0, 1346.0 / 1979.0),
            // DeepGEMM M = 64 dense GEMMs, 1688–2668 of 3350 GB/s (§4.1's
            // grouped decode GEMMs, 2133–2176, lie inside).
            "gemm_memory_efficiency" => (1688.0 / 3350.0, 2668.0 / 3350.0),
            // One measurement: 4.3 of 4.8 TB/s.
            "stream_memory_efficiency" => (4.3 / 4.8, 4.3 / 4.8),
            // DeepEP intranode EP8: 153 (dispatch) and 158 (combine) of 200 GB/s.
            "nvlink_efficiency" => (153.0 / 200.0, 158.0 / 200.0),
            // DeepEP internode EP16: 43 of 50 GB/s (its EP32/EP64 rows count
            // NVLink-forwarded bytes too, so they exceed the NIC's rate).
            "rdma_efficiency" => (43.0 / 50.0, 43.0 / 50.0),
            // DeepEP low-latency entries less their bytes: 24 µs (EP256) to 30 µs (EP16).
            "comm_floor" => (24e-6, 30e-6),
            // Moebius Fig. 12's 6.95× is the largest eager slowdown; with this
            // model's own graph step (13.9 ms over 94 layers) that bounds it at
            // 1 ms: a model-derived bound on a published ratio.
            "eager_layer" => (0.0, 1.0e-3),
            // Fig. 12's two partitions: Green Context (4.07×, 1.24×) 0.935 and
            // MPS (3.33×, 1.34×) 0.938.
            "stream_sm_saturation" => (1.24 * (1.0 - 1.0 / 4.07), 1.34 * (1.0 - 1.0 / 3.33)),
            _ => return None,
        })
    }

    /// The same constants with `name` scaled by `factor`; `None` for an unknown name.
    pub fn scaled(&self, name: &str, factor: f64) -> Option<Calibration> {
        let mut c = *self;
        let v = match name {
            "compute_efficiency" => &mut c.compute_efficiency,
            "gemm_memory_efficiency" => &mut c.gemm_memory_efficiency,
            "stream_memory_efficiency" => &mut c.stream_memory_efficiency,
            "nvlink_efficiency" => &mut c.nvlink_efficiency,
            "rdma_efficiency" => &mut c.rdma_efficiency,
            "comm_floor" => &mut c.comm_floor,
            "normal_mode_sync" => &mut c.normal_mode_sync,
            "op_overhead" => &mut c.op_overhead,
            "eager_layer" => &mut c.eager_layer,
            "iteration_overhead" => &mut c.iteration_overhead,
            "stream_sm_saturation" => &mut c.stream_sm_saturation,
            _ => return None,
        };
        *v *= factor;
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_can_be_scaled_by_its_name() {
        let c = Calibration::published();
        for (name, value, source) in c.entries() {
            let s = c.scaled(name, 1.2).expect(name);
            let moved: Vec<_> =
                s.entries().iter().zip(c.entries()).filter(|(a, b)| a.1 != b.1).map(|(a, _)| a.0).collect();
            assert_eq!(moved, vec![name], "{name}");
            assert!((s.entries().iter().find(|e| e.0 == name).map_or(0.0, |e| e.1) / value - 1.2).abs() < 1e-12);
            assert!(!source.is_empty());
        }
        assert!(c.scaled("l2", 2.0).is_none());
    }

    #[test]
    fn published_constants_lie_in_their_published_ranges() {
        let c = Calibration::published();
        let mut ranged = 0;
        for (name, value, source) in c.entries() {
            match Calibration::published_range(name) {
                Some((lo, hi)) => {
                    ranged += 1;
                    assert!(
                        lo <= value * (1.0 + 1e-12) && value <= hi * (1.0 + 1e-12),
                        "{name} {value} not in {lo}–{hi}"
                    );
                    assert!(!source.starts_with("assumed"), "{name} has a range but says it is assumed");
                }
                None => assert!(source.starts_with("assumed"), "{name} cites a source but has no range"),
            }
        }
        assert_eq!(ranged, 8);
    }
}
