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

/// A unit's conversion to its base unit: `10^dec · mult`. The decimal part
/// is applied to the written numeral's exponent, so `5us` is exactly the f64
/// nearest 5e-6 (not 5 × 1e-6, which is not).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Factor {
    pub dec: i32,
    pub mult: f64,
}

const fn f(dec: i32, mult: f64) -> Factor {
    Factor { dec, mult }
}

fn size_factor(s: &str) -> Option<Factor> {
    const KI: f64 = 1024.0;
    Some(match s {
        "B" => f(0, 1.0),
        "KB" | "kB" => f(3, 1.0),
        "MB" => f(6, 1.0),
        "GB" => f(9, 1.0),
        "TB" => f(12, 1.0),
        "KiB" => f(0, KI),
        "MiB" => f(0, KI * KI),
        "GiB" => f(0, KI * KI * KI),
        "TiB" => f(0, KI * KI * KI * KI),
        "b" => f(0, 0.125),
        "Kb" | "kb" => f(3, 0.125),
        "Mb" => f(6, 0.125),
        "Gb" => f(9, 0.125),
        "Tb" => f(12, 0.125),
        _ => return None,
    })
}

fn time_factor(s: &str) -> Option<Factor> {
    Some(match s {
        "ns" => f(-9, 1.0),
        "us" | "µs" => f(-6, 1.0),
        "ms" => f(-3, 1.0),
        "s" => f(0, 1.0),
        "min" => f(0, 60.0),
        _ => return None,
    })
}

fn flop_factor(s: &str) -> Option<Factor> {
    Some(match s {
        "FLOP" => f(0, 1.0),
        "GFLOP" => f(9, 1.0),
        "TFLOP" => f(12, 1.0),
        "PFLOP" => f(15, 1.0),
        _ => return None,
    })
}

/// Parses a unit suffix into its dimension and conversion to the base unit.
pub fn parse_unit(unit: &str) -> Option<(Dim, Factor)> {
    if unit.is_empty() {
        return Some((Dim::None, f(0, 1.0)));
    }
    if unit == "%" {
        return Some((Dim::None, f(-2, 1.0)));
    }
    if let Some((num, den)) = unit.split_once('/') {
        let per = time_factor(den)?;
        let over = |x: Factor| f(x.dec - per.dec, x.mult / per.mult);
        if num.is_empty() || num == "req" {
            return Some((Dim::Rate, over(f(0, 1.0))));
        }
        if let Some(x) = size_factor(num) {
            return Some((Dim::Bandwidth, over(x)));
        }
        if let Some(x) = flop_factor(num) {
            return Some((Dim::FlopRate, over(x)));
        }
        return None;
    }
    if let Some(x) = size_factor(unit) {
        return Some((Dim::Bytes, x));
    }
    if let Some(x) = time_factor(unit) {
        return Some((Dim::Time, x));
    }
    None
}

/// The value of numeral `text` in `factor`'s base unit. Infinite on overflow.
pub fn to_base(text: &str, factor: Factor) -> f64 {
    let (mantissa, exp) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i64>().unwrap_or(i64::MAX / 2)),
        None => (text, 0),
    };
    let total = exp.saturating_add(i64::from(factor.dec)).clamp(-100_000, 100_000);
    let v: f64 = format!("{mantissa}e{total}").parse().unwrap_or(f64::NAN);
    v * factor.mult
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
        let check = |u: &str, d: Dim, want: f64| {
            let (dim, fac) = parse_unit(u).unwrap_or((Dim::None, f(0, f64::NAN)));
            assert_eq!(dim, d, "{u}");
            let got = to_base("1", fac);
            assert!((got - want).abs() <= want.abs() * 1e-12, "{u}: {got} vs {want}");
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
    fn decimal_units_are_exact() {
        assert_eq!(to_base("5", parse_unit("us").map(|x| x.1).unwrap_or(f(0, 0.0))), 5e-6);
        assert_eq!(to_base("4.8", parse_unit("TB/s").map(|x| x.1).unwrap_or(f(0, 0.0))), 4.8e12);
        assert_eq!(to_base("1.5e3", parse_unit("ms").map(|x| x.1).unwrap_or(f(0, 0.0))), 1.5);
        assert_eq!(to_base("200", parse_unit("Gb/s").map(|x| x.1).unwrap_or(f(0, 0.0))), 25e9);
        assert!(to_base("1e400", f(0, 1.0)).is_infinite());
    }

    #[test]
    fn human_forms() {
        assert_eq!(human(141e9, Dim::Bytes), "141GB");
        assert_eq!(human(4.8e12, Dim::Bandwidth), "4.8TB/s");
        assert_eq!(human(2e-6, Dim::Time), "2us");
        assert_eq!(human(0.05, Dim::Time), "50ms");
    }
}
