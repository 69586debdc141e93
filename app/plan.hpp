// Memory planning for fsdp-train decks (app layer): predicts, per rank, the bytes of every part of a
// run (parameter shards, gradients, optimizer state, gathered unit buffers, activations, data, the
// process baseline) from the deck alone, and finds the largest model of the deck's family that fits a
// memory budget. No MPI and no model tensors: the model is described in closed form (module tree,
// parameter shapes), the FSDP units are derived from it exactly as the engine's UnitBuilder
// does, and one training step is replayed as a sequence of allocations and frees whose
// high-water mark is the prediction. Used by fsdp-plan (app/fsdp_plan.cpp); docs/planning.md explains
// the model and its limits, tests/plan_e2e.cmake checks it against fsdp-train's measured peak RSS.
#pragma once

#include "plan/largest_fitting.hpp"
#include "plan/measured.hpp"
#include "plan/model_desc.hpp"
#include "models/families.hpp"
#include "plan/run_shape.hpp"
#include "plan/forward_trace.hpp"
#include "plan/memory_model.hpp"
#include "plan/simulate.hpp"
#include "plan/root_unit.hpp"
