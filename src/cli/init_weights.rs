//! `moeforge init-weights SPEC -o DIR`: a random bf16 checkpoint of the
//! spec's model in Hugging Face safetensors names, for the CPU twin.

use super::{error, fail, load, out, pick, Format};
use clap::ValueEnum;
use moeforge::runtime::twin;
use std::path::PathBuf;
use std::process::ExitCode;

/// Tensor naming of the written checkpoint.
#[derive(Clone, Copy, ValueEnum)]
pub enum Family {
    /// Qwen3-MoE names (`mlp.experts.E.gate_proj`).
    #[value(name = "qwen3-moe", alias = "qwen3_moe")]
    Qwen3Moe,
    /// Mixtral names (`block_sparse_moe.experts.E.w1`).
    Mixtral,
}

#[derive(clap::Args)]
pub struct Args {
    /// A `.moe` file holding the model (through a deployment or alone).
    spec: PathBuf,
    /// Which deployment's model, when the file has several.
    #[arg(long)]
    deploy: Option<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (model.safetensors).
    #[arg(short, long)]
    output: PathBuf,
    #[arg(long, value_enum, default_value = "qwen3-moe")]
    family: Family,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let checked = load(&Some(a.spec)).0.map_err(|f| fail(&f.sources, &f.diagnostics, Format::Human))?;
    let model = match (a.deploy, checked.spec.models.len()) {
        (Some(d), _) => {
            let id = pick(&checked, Some(&d)).map_err(|x| fail(&checked.sources, &x, Format::Human))?;
            checked.spec.model(checked.spec.deploy(id).model).clone()
        }
        (None, 1) => checked.spec.models[0].clone(),
        (None, _) => {
            let id = pick(&checked, None).map_err(|x| fail(&checked.sources, &x, Format::Human))?;
            checked.spec.model(checked.spec.deploy(id).model).clone()
        }
    };
    let family = match a.family {
        Family::Qwen3Moe => twin::weights::Family::Qwen3Moe,
        Family::Mixtral => twin::weights::Family::Mixtral,
    };
    let tm = twin::TwinModel::from_spec(&model).map_err(|e| error(e, ""))?;
    twin::weights::write_random(&tm, a.seed, family, &a.output).map_err(|e| error(e, ""))?;
    let params: usize = tm.tensor_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    out(&format!(
        "wrote {} ({} parameters, seed {}) to {}",
        model.name,
        params,
        a.seed,
        a.output.join("model.safetensors").display()
    ));
    Ok(())
}
