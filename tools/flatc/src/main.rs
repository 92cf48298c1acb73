//! Prints the path of the pinned `flatc` that the `flatc` crate built from
//! source (flatbuffers 23.5.26). `tools/regen-schema.sh` runs it; nothing
//! else should depend on this project.

fn main() {
    println!("{}", flatc::flatc().display());
}
