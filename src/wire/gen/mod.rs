//! The Rust code that the pinned `flatc` (23.5.26) generates from
//! `schema/lbagent.fbs`, namespace `lbagent.fb`, re-exported flat.
//!
//! `lbagent_generated.rs` is generated: never edit it by hand. Change the
//! schema, run `tools/regen-schema.sh` and commit both; CI runs
//! `tools/regen-schema.sh --check`. Only this module relaxes lints.

// The generator's output, not ours to tidy: no docs on accessors, its own
// imports and lifetime style. `unknown_lints` keeps toolchains older than the
// `mismatched_lifetime_syntaxes` lint (1.89) quiet.
#[allow(
    unknown_lints,
    clippy::all,
    missing_docs,
    unused_imports,
    mismatched_lifetime_syntaxes,
    unsafe_op_in_unsafe_fn
)]
#[rustfmt::skip]
mod lbagent_generated;

pub use self::lbagent_generated::lbagent::fb::*;
