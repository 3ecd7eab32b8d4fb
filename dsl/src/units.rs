//! Quantities with units.
//!
//! A number in a spec may carry a unit suffix written without a space:
//! `141GB`, `4.8TB/s`, `200Gb/s` (bits), `2us`, `50ms`, `989TFLOP/s`,
//! `4req/s`, `85%`. Each suffix has a [`Dim`]ension and a factor to the
//! dimension's base unit (bytes, seconds, bytes/s, FLOP/s, 1/s, 1). Fields
//! declare the dimension they accept; a mismatch is an error, never a silent
//! conversion.

use serde::Serialize;
use std::fmt;

/// The physical dimension of a quantity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Dim {
    /// A plain number (counts, ratios). `%` divides by 100.
    None,
    /// Bytes (decimal `KB/MB/GB/TB`, binary `KiB/MiB/GiB/TiB`, bits `b/Kb/Mb/Gb/Tb`).
    Bytes,
    /// Seconds (`ns`, `us`/`µs`, `ms`, `s`).
    Time,
    /// Bytes per second (`GB/s`, `Gb/s`, …).
    Bandwidth,
    /// Floating-point operations per second (`TFLOP/s`, …).
    FlopRate,
    /// Events per second (`req/s`, `/s`).
    Rate,
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dim::None => "a plain number",
            Dim::Bytes => "a size (e.g. `80GB`, `228KiB`)",
            Dim::Time => "a duration (e.g. `2us`, `50ms`, `1s`)",
            Dim::Bandwidth => "a bandwidth (e.g. `450GB/s`, `200Gb/s`)",
            Dim::FlopRate => "a compute rate (e.g. `989TFLOP/s`)",
            Dim::Rate => "a rate (e.g. `4req/s`)",
        })
    }
}

fn size_factor(s: &str) -> Option<f64> {
    Some(match s {
        "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "b" => 1.0 / 8.0,
        "Kb" | "kb" => 1e3 / 8.0,
        "Mb" => 1e6 / 8.0,
        "Gb" => 1e9 / 8.0,
        "Tb" => 1e12 / 8.0,
        _ => return None,
    })
}

fn time_factor(s: &str) -> Option<f64> {
    Some(match s {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "min" => 60.0,
        _ => return None,
    })
}

fn flop_factor(s: &str) -> Option<f64> {
    Some(match s {
        "FLOP" => 1.0,
        "GFLOP" => 1e9,
        "TFLOP" => 1e12,
        "PFLOP" => 1e15,
        _ => return None,
    })
}

/// Parses a unit suffix into its dimension and factor to the base unit.
pub fn parse_unit(unit: &str) -> Option<(Dim, f64)> {
    if unit.is_empty() {
        return Some((Dim::None, 1.0));
    }
    if unit == "%" {
        return Some((Dim::None, 0.01));
    }
    if let Some((num, den)) = unit.split_once('/') {
        let per = time_factor(den)?;
        if num.is_empty() || num == "req" {
            return Some((Dim::Rate, 1.0 / per));
        }
        if let Some(f) = size_factor(num) {
            return Some((Dim::Bandwidth, f / per));
        }
        if let Some(f) = flop_factor(num) {
            return Some((Dim::FlopRate, f / per));
        }
        return None;
    }
    if let Some(f) = size_factor(unit) {
        return Some((Dim::Bytes, f));
    }
    if let Some(f) = time_factor(unit) {
        return Some((Dim::Time, f));
    }
    None
}

/// Formats a value in base units with a readable suffix (for reports).
pub fn human(value: f64, dim: Dim) -> String {
    fn scaled(v: f64, steps: &[(f64, &str)]) -> String {
        for &(f, s) in steps {
            if v.abs() >= f {
                return format!("{}{s}", trim(v / f));
            }
        }
        let (f, s) = steps[steps.len() - 1];
        format!("{}{s}", trim(v / f))
    }
    match dim {
        Dim::None => trim(value),
        Dim::Bytes => scaled(value, &[(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1.0, "B")]),
        Dim::Time => scaled(value, &[(1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")]),
        Dim::Bandwidth => scaled(value, &[(1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1.0, "B/s")]),
        Dim::FlopRate => scaled(value, &[(1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1.0, "FLOP/s")]),
        Dim::Rate => format!("{}req/s", trim(value)),
    }
}

/// Up to three decimals, no trailing zeros.
fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse_to_base() {
        let check = |u: &str, d: Dim, f: f64| {
            let (dim, fac) = parse_unit(u).unwrap_or((Dim::None, f64::NAN));
            assert_eq!(dim, d, "{u}");
            assert!((fac - f).abs() <= f.abs() * 1e-12, "{u}: {fac} vs {f}");
        };
        check("GiB", Dim::Bytes, 1073741824.0);
        check("GB", Dim::Bytes, 1e9);
        check("TB/s", Dim::Bandwidth, 1e12);
        check("Gb/s", Dim::Bandwidth, 1.25e8);
        check("us", Dim::Time, 1e-6);
        check("µs", Dim::Time, 1e-6);
        check("TFLOP/s", Dim::FlopRate, 1e12);
        check("req/s", Dim::Rate, 1.0);
        check("%", Dim::None, 0.01);
        assert!(parse_unit("parsecs").is_none());
        assert!(parse_unit("GB/parsec").is_none());
    }

    #[test]
    fn human_forms() {
        assert_eq!(human(141e9, Dim::Bytes), "141GB");
        assert_eq!(human(4.8e12, Dim::Bandwidth), "4.8TB/s");
        assert_eq!(human(2e-6, Dim::Time), "2us");
        assert_eq!(human(0.05, Dim::Time), "50ms");
    }
}
