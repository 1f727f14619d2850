#!/bin/bash
# Where the typed row's microseconds at 85 KiB go (README beside): each script under mpirun as
# `snowcat bench transport` runs its ranks (Open MPI over TCP), medians of 199 transfers (µs).
#   poll.py [BYTES]   raw Send/Recv, Isend/Irecv + Wait, Isend/Irecv polled with Test in a bare Python loop
#   msg.py [BYTES]    raw, MPITransport send_message+recv_message, its send alone (raw receive), its receive alone
#   typed.py          raw, message, typed (send_batch/recv_batch) on a 2-episode batch; rank 0 times its read
#                     just after the receive against the same read in a loop (99 transfers)
# usage: bash run.sh PYTHON   (from the checkout, with snowcat importable)
set -e
here=$(dirname "$0")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,tcp OMP_WAIT_POLICY=PASSIVE
run() { mpirun -n 2 --oversubscribe --bind-to none "$1" "${@:2}"; }
for n in 87000 277000; do run "$1" "$here/poll.py" $n; done
for n in 87000 87000 277000; do run "$1" "$here/msg.py" $n; done
for i in 1 2; do run "$1" "$here/typed.py"; done
