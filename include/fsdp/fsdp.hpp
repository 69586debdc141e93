// The public API of fsdp: include this one header.
//   core/   flat layout math          comm/  Communicator concept, MpiComm
//   torch/  FullyShardedDataParallel, wrap policies, fsdp::forward, optimizers
//   io/     HDF5 checkpoints (save_checkpoint, load_checkpoint, resume_from_latest, load_full_state_dict)
#pragma once

#include "fsdp/comm/agree.hpp"
#include "fsdp/comm/communicator.hpp"
#include "fsdp/comm/mpi_comm.hpp"
#include "fsdp/core/device_choice.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/loss_scale.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/core/text.hpp"
#include "fsdp/core/unit_plan.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/io/checkpoint.hpp"
#include "fsdp/io/safetensors.hpp"
#include "fsdp/torch/fully_sharded.hpp"
#include "fsdp/torch/hooks.hpp"
#include "fsdp/torch/optim/adadelta.hpp"
#include "fsdp/torch/optim/one_pass_adam.hpp"
#include "fsdp/torch/optim_state.hpp"
#include "fsdp/torch/wrap_policy.hpp"
#include "fsdp/version.hpp"
