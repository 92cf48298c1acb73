//! What the three `/metrics` endpoints (the agent, the route server, the
//! reporter) share when they write their families through prometheus-client:
//! a table of figures, a family of integer samples, and counts as the library
//! writes integers.
//!
//! The endpoints serve the Prometheus text format 0.0.4, which names a
//! counter family by its sample (`lbagent_requests_total`);
//! prometheus-client's own counter writes OpenMetrics (family
//! `lbagent_requests`, samples suffixed `_total`), which a 0.0.4 reader and
//! `promtool check metrics` take for an untyped family without HELP. So each
//! family is declared under its 0.0.4 name and its samples are written as
//! they are (`encode_gauge`, which adds no suffix).

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::MetricType;

/// A figure read from a `T`: its family name, TYPE, HELP, and how to read
/// its value.
pub type Figure<T> = (&'static str, MetricType, &'static str, fn(&T) -> u64);

/// Writes each of `figures` as a family of one sample without labels, read
/// from `of`, in order.
pub fn figures<T>(e: &mut DescriptorEncoder, figures: &[Figure<T>], of: &T) -> fmt::Result {
    for (name, ty, help, get) in figures {
        sample(e, name, *ty, help, get(of))?;
    }
    Ok(())
}

/// Writes a family of one sample without labels.
pub fn sample(
    e: &mut DescriptorEncoder,
    name: &str,
    ty: MetricType,
    help: &str,
    v: u64,
) -> fmt::Result {
    e.encode_descriptor(name, help, None, ty)?
        .encode_gauge(&int(v))
}

/// Writes one family: its HELP and TYPE lines, then a sample per
/// `(labels, value)` of `series`, in order.
pub fn family<L: EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    name: &str,
    ty: MetricType,
    help: &str,
    series: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in series {
        m.encode_family(&labels)?.encode_gauge(&int(v))?;
    }
    Ok(())
}

/// A count as prometheus-client writes integers (i64; no count of ours
/// comes near its bound, and one that did would read as `i64::MAX`).
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_past_i64_saturate() {
        assert_eq!(int(7), 7);
        assert_eq!(int(u64::MAX), i64::MAX);
    }
}
