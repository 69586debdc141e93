// Checkpoints of an FSDP model on HDF5 (io layer): SHARDED (one file written by all ranks in parallel
// over MPI-IO), FULL (rank 0 writes, gathering one unit at a time) and LOCAL (a folder with each
// rank's raw flat shard). SHARDED and FULL files share one schema, keyed by parameter names in their
// logical shapes, so any world size and any strategy can load them; see docs/checkpoint_format.md.
//
// Loading reads everything into staging tensors first and the ranks agree that every read succeeded
// before anything in the model or optimizer changes: a corrupt file fails on every rank, leaves the
// model as it was, and lets resume_from_latest() fall back to an older checkpoint.
//
// The parts: checkpoint_options.hpp (the public types), checkpoint_state.hpp (what is stored where),
// checkpoint_save.hpp, checkpoint_load.hpp, full_state_dict.hpp (no engine, no MPI),
// checkpoint_files.hpp (names, commit, `latest`, pruning), h5.hpp (the HDF5 calls),
// async_checkpoint.hpp (saves written on an I/O thread from a host snapshot).
#pragma once

#include "fsdp/io/async_checkpoint.hpp"
#include "fsdp/io/checkpoint_load.hpp"
#include "fsdp/io/checkpoint_options.hpp"
#include "fsdp/io/checkpoint_save.hpp"
#include "fsdp/io/full_state_dict.hpp"
