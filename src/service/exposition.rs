//! What the three `/metrics` endpoints (the agent, the route server, the
//! reporter) share when they write their families through prometheus-client:
//! a family of integer samples, and counts as the library writes integers.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::MetricType;

/// Writes one family: its HELP and TYPE lines, then a sample per
/// `(labels, value)` of `series`, in order. Counters are declared under
/// their `_total` name and written as plain samples (prometheus-client's
/// own counter writes the OpenMetrics form, which the text format 0.0.4
/// these endpoints serve does not have).
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
pub fn int(v: u64) -> i64 {
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
