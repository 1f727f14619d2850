#!/bin/sh
# The MPI of every snowcat image that joins a hetjob's MPI world (trainer.def, rollout.def,
# rollout-aarch64.def run this in %post). RL runs trainer and rollout ranks as one heterogeneous
# job step, `srun --mpi=<site plugin> --het-group=0 trainer.sif : --het-group=1 rollout.sif`, and
# one MPI_COMM_WORLD across both images needs the same MPI in both: the same Open MPI release,
# configured the same way (nothing detected from the base image: the trainer's NGC base ships
# HPC-X with UCX, vLLM's base ships no MPI at all), and mpi4py built against it. A pip wheel of
# mpi4py alone installs without any MPI library and fails only at `from mpi4py import MPI`.
#
# Launch: srun starts every rank directly and Open MPI's PMIx client (internal PMIx 3.2) talks to
# srun's PMIx server: `--mpi=pmix` with Slurm's plugin (OpenMPI sites, the local test cluster),
# `--mpi=pspmix` at JSC (ParaStation's PMIx server; docs/admins.md). Transport: ob1 over TCP and
# shared memory, pinned in each image's %environment (OMPI_MCA_pml/btl), so both sides always pick
# the same PML; trajectories are small next to the weights, which go through the filesystem.
#
# Run from %post as `sh /opt/snowcat/containers/mpi.sh`; needs internet at build time (login node).
set -eu

OMPI_VERSION=4.1.8
# sha256 of openmpi-4.1.8.tar.bz2 as Open MPI publishes it (the same in Spack's openmpi package).
OMPI_SHA256=466f68e3132a1dc02710cc2011fafced8336d98359fa2dae4dddcfd5719f12a9
OMPI_URL="https://download.open-mpi.org/release/open-mpi/v4.1/openmpi-${OMPI_VERSION}.tar.bz2"
MPI4PY_VERSION=4.1.2
PREFIX=/opt/snowcat-mpi

if ! command -v make >/dev/null || ! command -v gcc >/dev/null || ! command -v curl >/dev/null || ! command -v bzip2 >/dev/null; then
    apt-get update
    apt-get install -y --no-install-recommends build-essential ca-certificates curl bzip2
    rm -rf /var/lib/apt/lists/*
fi

work=$(mktemp -d)
curl -fsSL --retry 3 -o "$work/openmpi.tar.bz2" "$OMPI_URL"
echo "$OMPI_SHA256  $work/openmpi.tar.bz2" | sha256sum -c -
tar -xjf "$work/openmpi.tar.bz2" -C "$work"
cd "$work/openmpi-${OMPI_VERSION}"
./configure --prefix="$PREFIX" \
    --with-slurm --with-pmix=internal --with-libevent=internal --with-hwloc=internal \
    --without-ucx --without-verbs --without-ofi --without-psm --without-psm2 --without-cuda \
    --disable-oshmem --disable-mpi-fortran
make -j"$(nproc)"
make install
cd /
rm -rf "$work"

# mpi4py built from source against this MPI (never the binary wheel, which brings none).
export PATH="$PREFIX/bin:$PATH"
export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MPICC="$PREFIX/bin/mpicc" python3 -m pip install --no-cache-dir --no-binary=mpi4py "mpi4py==${MPI4PY_VERSION}"

# The image is built only if mpi4py loads this very MPI.
python3 -c "from mpi4py import MPI; v = MPI.Get_library_version(); assert v.startswith('Open MPI v${OMPI_VERSION}'), v; print(v.splitlines()[0])"
