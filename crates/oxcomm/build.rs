//! Build script. Does nothing unless the `mpi` feature is on; then it compiles
//! `src/backend/in_place.c`, which hands Rust the value of `MPI_IN_PLACE` (a C macro that
//! rsmpi's generated bindings cannot carry), with the MPI installation's compiler wrapper.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "mpi")]
    mpi_shim();
}

#[cfg(feature = "mpi")]
fn mpi_shim() {
    println!("cargo:rerun-if-changed=src/backend/in_place.c");
    let lib = match build_probe_mpi::probe() {
        Ok(lib) => lib,
        Err(errs) => {
            for e in errs {
                println!("cargo:warning=MPI probe: {e}");
            }
            panic!("feature `mpi`: no MPI installation found (install Open MPI or MPICH: mpicc must be on PATH)");
        }
    };
    let mut build = cc::Build::new();
    build.file("src/backend/in_place.c");
    match lib.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            for dir in &lib.include_paths {
                build.include(dir);
            }
        }
    }
    build.compile("oxcomm_mpi_shim");
}
