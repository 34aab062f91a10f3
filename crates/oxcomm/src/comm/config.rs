//! The communicator's settings: [`CommConfig`] (per communicator, with its defaults read from
//! the environment) and [`OpOptions`] (per op). Every `OXCOMM_*` variable the communicator
//! itself reads is declared here with its default; the logger's are in [`crate::logging`].

use std::time::Duration;

use crate::algorithms::Algorithm;
use crate::logging::LoggerConfig;

/// Environment variable: default deadline of every blocking op, in seconds.
pub const ENV_TIMEOUT: &str = "OXCOMM_TIMEOUT";
/// Default of [`ENV_TIMEOUT`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default largest number of bytes one transfer call moves.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;

/// Settings of a communicator. `Default` reads [`ENV_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of every blocking op unless [`OpOptions::timeout`] overrides it, counted
    /// from the first time the op has to wait for a peer.
    pub timeout: Duration,
    /// Largest number of bytes one transfer call moves; larger messages go in segments.
    pub max_segment_bytes: usize,
    /// Use this algorithm for every op it applies to (tests and benchmarks); `None` lets
    /// [`crate::algorithms::plan`] choose.
    pub algorithm: Option<Algorithm>,
    /// The comms logger's settings (default: from `OXCOMM_COMMS_LOGGER*`, off if unset).
    pub logger: LoggerConfig,
}

impl Default for CommConfig {
    fn default() -> Self {
        let timeout = std::env::var(ENV_TIMEOUT)
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        let logger = LoggerConfig::from_env().unwrap_or_else(|e| {
            tracing::warn!(target: "oxcomm::comms", "ignoring the comms logger settings: {e}");
            LoggerConfig::default()
        });
        CommConfig { timeout, max_segment_bytes: DEFAULT_MAX_SEGMENT_BYTES, algorithm: None, logger }
    }
}

/// Per-op knobs; `Default` means "use the communicator's settings".
#[derive(Debug, Clone, Default)]
pub struct OpOptions {
    /// Deadline of this op (counted from its first wait for a peer).
    pub timeout: Option<Duration>,
    /// Force an algorithm; an error if it does not apply to the op.
    pub algorithm: Option<Algorithm>,
    /// Segment size of this op.
    pub max_segment_bytes: Option<usize>,
}
