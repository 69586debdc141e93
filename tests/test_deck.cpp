// Input decks (app layer): schema, parsing, every kind of error with its line, --set overrides,
// the resolved deck round trip, and docs/deck_reference.md against the schema. No MPI, no LibTorch.
#define BOOST_TEST_MODULE test_deck
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "fsdp/file_tree.hpp"
#include "deck.hpp"
#include "hf_export.hpp"
#include "models/llama_hf.hpp"
#include "run_config.hpp"

using namespace fsdp::app;
namespace fs = std::filesystem;

namespace {

/// The problems of a deck that must fail to parse.
std::vector<std::string> problems_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    Deck::parse(text, "inputs/a.toml", overrides);
  } catch (const DeckError& e) {
    return e.problems();
  }
  BOOST_FAIL("the deck parsed but should not have:\n" + text);
  return {};
}

/// The only problem of a deck that must fail to parse.
std::string problem_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  const auto p = problems_of(text, overrides);
  BOOST_TEST_REQUIRE(p.size() == 1u, "expected one problem, got " << p.size() << ":\n" << (p.empty() ? "" : p[0]));
  return p[0];
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

BOOST_AUTO_TEST_CASE(schema_is_consistent) {
  std::set<std::string> keys;
  for (const auto& s : deck_schema()) {
    BOOST_TEST_CONTEXT(s.key) {
      BOOST_TEST(keys.insert(s.key).second);  // unique
      BOOST_TEST(s.key.find('.') != std::string::npos);
      BOOST_TEST(!s.description.empty());
      BOOST_TEST(find_key(s.key) == &s);
      // Every default passes its own checks (monostate means unset).
      Deck d;
      BOOST_CHECK_NO_THROW(d.set(s.key, s.default_value));
      for (const auto& f : s.fields) {  // an array of tables' fields are scalars, described, with defaults that pass their checks
        BOOST_TEST_CONTEXT(s.key << "." << f.key) {
          BOOST_TEST((s.type == KeyType::kTables));
          BOOST_TEST((f.type == KeyType::kInt || f.type == KeyType::kFloat || f.type == KeyType::kBool || f.type == KeyType::kString));
          BOOST_TEST(!f.description.empty());
          BOOST_TEST(f.fields.empty());
          if (!std::holds_alternative<std::monostate>(f.default_value)) BOOST_TEST((f.default_value.index() == std::size_t(f.type) + 1));
        }
      }
      if (!s.choices.empty()) {
        const auto* def = std::get_if<std::string>(&s.default_value);
        BOOST_TEST_REQUIRE(def != nullptr);
        BOOST_TEST((std::find(s.choices.begin(), s.choices.end(), *def) != s.choices.end()));
      }
    }
  }
  const std::vector<std::string> sections{"run", "model", "data", "optim", "fsdp", "comm", "checkpoint", "eval", "log"};
  BOOST_TEST(deck_sections() == sections, boost::test_tools::per_element());
  BOOST_TEST(find_key("optim.nope") == nullptr);
}

BOOST_AUTO_TEST_CASE(defaults_when_the_deck_is_empty) {
  const Deck d = Deck::parse("", "empty.toml");
  BOOST_TEST(d.entries().size() == deck_schema().size());
  for (std::size_t i = 0; i < d.entries().size(); ++i) {
    const Entry& e = d.entries()[i];
    BOOST_TEST(e.spec == &deck_schema()[i]);
    BOOST_TEST((e.value == e.spec->default_value));
    BOOST_TEST((e.source == Source::kDefault));
    BOOST_TEST(e.line == 0);
  }
  BOOST_TEST(d.get_string("run.name") == "fsdp");
  BOOST_TEST(d.get_int("run.epochs") == 2);
  BOOST_TEST(d.get_float("optim.lr") == 1.0);
  BOOST_TEST(d.get_float("optim.gamma") == 0.7);
  BOOST_TEST(d.get_string("optim.kind") == "adadelta");
  BOOST_TEST(d.get_string("fsdp.sharding_strategy") == "FULL_SHARD");
  BOOST_TEST(d.get_bool("data.shuffle"));
  BOOST_TEST((d.get_int_array("model.hidden_sizes") == std::vector<std::int64_t>{512, 256}));
  BOOST_TEST((d.get_float_array("optim.betas") == std::vector<double>{0.9, 0.999}));
  BOOST_TEST(!d.is_set("model.dropout"));
  BOOST_TEST(d.is_set("optim.lr"));
  BOOST_CHECK_THROW(d.get_float("model.dropout"), DeckError);
  BOOST_TEST(d.out_dir() == "runs/fsdp");
  BOOST_TEST(d.checkpoint_dir() == "runs/fsdp/checkpoints");
  // Comments and empty sections are fine too.
  const Deck c = Deck::parse("# nothing\n[run]\n[optim]\n", "c.toml");
  BOOST_TEST(c.get_int("run.seed") == 1);
}

BOOST_AUTO_TEST_CASE(values_sources_and_lines) {
  const std::string text =
      "# a deck\n"                              // 1
      "[run]\n"                                 // 2
      "name = \"exp\"\n"                        // 3
      "epochs = 5\n"                            // 4
      "\n"                                      // 5
      "[model]\n"                               // 6
      "kind = \"mlp\"\n"                        // 7
      "dropout = 0\n"                           // 8
      "hidden_sizes = [64, 32, 16]\n"           // 9
      "[optim]\n"                               // 10
      "lr = 2\n"                                // 11  an int for a float key
      "betas = [0.5, 0.75]\n"                   // 12
      "[fsdp]\n"                                // 13
      "sharding_strategy = \"HYBRID_SHARD\"\n"  // 14
      "reshard_after_forward = false\n"         // 15  a boolean for a true/false choice
      "[checkpoint]\n"                          // 16
      "dir = \"/scratch/ckpt\"\n";              // 17
  const Deck d = Deck::parse(text, "inputs/a.toml");
  BOOST_TEST(d.text() == text);
  BOOST_TEST(d.path() == "inputs/a.toml");
  BOOST_TEST(d.get_string("run.name") == "exp");
  BOOST_TEST(d.get_int("run.epochs") == 5);
  BOOST_TEST(d.get_string("model.kind") == "mlp");
  BOOST_TEST(d.is_set("model.dropout"));
  BOOST_TEST(d.get_float("model.dropout") == 0.0);
  BOOST_TEST((d.get_int_array("model.hidden_sizes") == std::vector<std::int64_t>{64, 32, 16}));
  BOOST_TEST(d.get_float("optim.lr") == 2.0);
  BOOST_TEST((d.get_float_array("optim.betas") == std::vector<double>{0.5, 0.75}));
  BOOST_TEST(d.get_string("fsdp.sharding_strategy") == "HYBRID_SHARD");
  BOOST_TEST(d.get_string("fsdp.reshard_after_forward") == "false");
  BOOST_TEST(d.out_dir() == "runs/exp");
  BOOST_TEST(d.checkpoint_dir() == "/scratch/ckpt");
  const Entry& lr = d.entry("optim.lr");
  BOOST_TEST((lr.source == Source::kDeck));
  BOOST_TEST(lr.line == 11);
  BOOST_TEST(lr.where == "inputs/a.toml:11");
  BOOST_TEST(d.entry("run.name").line == 3);
  BOOST_TEST((d.entry("run.seed").source == Source::kDefault));
}

BOOST_AUTO_TEST_CASE(unknown_key_with_did_you_mean) {
  BOOST_TEST(problem_of("[run]\nseed = 1\n[optim]\nlrr = 0.1\n") == "inputs/a.toml:4: optim.lrr: unknown key (did you mean optim.lr?)");
  // The same name in another section.
  BOOST_TEST(problem_of("[optim]\nbatch_size = 8\n") == "inputs/a.toml:2: optim.batch_size: unknown key (did you mean data.batch_size?)");
  // A prefix, and a part of the name.
  BOOST_TEST(problem_of("[data]\n\nbatch = 8\n") == "inputs/a.toml:3: data.batch: unknown key (did you mean data.batch_size?)");
  BOOST_TEST(problem_of("[fsdp]\nstrategy = 'FULL_SHARD'\n") == "inputs/a.toml:2: fsdp.strategy: unknown key (did you mean fsdp.sharding_strategy?)");
  // Any case.
  BOOST_TEST(problem_of("[optim]\nLR = 0.1\n") == "inputs/a.toml:2: optim.LR: unknown key (did you mean optim.lr?)");
  // Nothing close: the section's keys are listed.
  const auto far = problem_of("[optim]\nquux = 1\n");
  BOOST_TEST(starts_with(far, "inputs/a.toml:2: optim.quux: unknown key (the keys of [optim] are kind, lr,"), far);
  // Outside any section.
  BOOST_TEST(problem_of("lr = 0.1\n") == "inputs/a.toml:1: lr: unknown key outside any section (did you mean optim.lr?)");
  // A table inside a section.
  BOOST_TEST(starts_with(problem_of("[optim]\n[optim.adam]\nbeta = 1\n"), "inputs/a.toml:2: optim.adam: unknown key"));
  BOOST_TEST(did_you_mean("optm.lr") == "optim.lr");
  BOOST_TEST(did_you_mean("checkpoint.every") == "checkpoint.every_steps");
  BOOST_TEST(did_you_mean("run.epoch") == "run.epochs");
  BOOST_TEST(did_you_mean("x.y").empty());
}

BOOST_AUTO_TEST_CASE(unknown_section) {
  BOOST_TEST(problem_of("[run]\nseed = 2\n\n[optimizer]\nlr = 1\n") == "inputs/a.toml:4: optimizer: unknown section (did you mean optim?)");
  BOOST_TEST(problem_of("[checkpoints]\n") == "inputs/a.toml:1: checkpoints: unknown section (did you mean checkpoint?)");
  BOOST_TEST(problem_of("[training]\n") ==
             "inputs/a.toml:1: training: unknown section (the sections are run, model, data, optim, fsdp, comm, checkpoint, eval, log)");
  BOOST_TEST(starts_with(problem_of("[[run]]\nseed = 1\n"), "inputs/a.toml:1: run: expected a table [run], got an array of tables"));
  BOOST_TEST(problem_of("run = 3\n") == "inputs/a.toml:1: run: expected a table [run], got an integer (3)");
}

BOOST_AUTO_TEST_CASE(wrong_type) {
  BOOST_TEST(problem_of("[data]\n\n\nbatch_size = \"64\"\n") == "inputs/a.toml:4: data.batch_size: expected an integer, got a string (\"64\")");
  BOOST_TEST(problem_of("[data]\nbatch_size = 6.4\n") == "inputs/a.toml:2: data.batch_size: expected an integer, got a float (6.4)");
  BOOST_TEST(problem_of("[optim]\nlr = \"fast\"\n") == "inputs/a.toml:2: optim.lr: expected a number, got a string (\"fast\")");
  BOOST_TEST(problem_of("[data]\nshuffle = 1\n") == "inputs/a.toml:2: data.shuffle: expected a boolean (true or false), got an integer (1)");
  BOOST_TEST(problem_of("[run]\nname = 7\n") == "inputs/a.toml:2: run.name: expected a string, got an integer (7)");
  BOOST_TEST(problem_of("[model]\nhidden_sizes = 64\n") == "inputs/a.toml:2: model.hidden_sizes: expected an array of integers, got an integer (64)");
  BOOST_TEST(problem_of("[model]\nhidden_sizes = [64, 3.5]\n") == "inputs/a.toml:2: model.hidden_sizes[1]: expected an integer, got a float (3.5)");
  BOOST_TEST(problem_of("[optim]\nbetas = [0.9, \"x\"]\n") == "inputs/a.toml:2: optim.betas[1]: expected a number, got a string (\"x\")");
  BOOST_TEST(problem_of("[run]\nname = 2024-01-01\n") == "inputs/a.toml:2: run.name: expected a string, got a date");
  // An array element on its own line is reported there.
  BOOST_TEST(problem_of("[model]\nhidden_sizes = [\n  64,\n  \"x\",\n]\n") ==
             "inputs/a.toml:4: model.hidden_sizes[1]: expected an integer, got a string (\"x\")");
}

BOOST_AUTO_TEST_CASE(out_of_range) {
  BOOST_TEST(problem_of("[optim]\nlr = -1\n") == "inputs/a.toml:2: optim.lr: -1 must be greater than 0");
  BOOST_TEST(problem_of("[optim]\nlr = 0.0\n") == "inputs/a.toml:2: optim.lr: 0 must be greater than 0");
  BOOST_TEST(problem_of("[run]\nepochs = 0\n") == "inputs/a.toml:2: run.epochs: 0 is below the minimum 1");
  BOOST_TEST(problem_of("[optim]\nweight_decay = -0.5\n") == "inputs/a.toml:2: optim.weight_decay: -0.5 is below the minimum 0");
  BOOST_TEST(problem_of("[model]\ndropout = 1.0\n") == "inputs/a.toml:2: model.dropout: 1 must be less than 1");
  BOOST_TEST(problem_of("[optim]\nbetas = [0.9, 1.5]\n") == "inputs/a.toml:2: optim.betas[1]: 1.5 must be less than 1");
  BOOST_TEST(problem_of("[optim]\nbetas = [0.9]\n") == "inputs/a.toml:2: optim.betas: expected 2 elements, got 1");
  BOOST_TEST(problem_of("[model]\nhidden_sizes = [64, 0]\n") == "inputs/a.toml:2: model.hidden_sizes[1]: 0 is below the minimum 1");
  BOOST_TEST(problem_of("[optim]\nclip_grad_norm = nan\n") == "inputs/a.toml:2: optim.clip_grad_norm: nan is not a finite number");
  BOOST_TEST(problem_of("[optim]\nclip_grad_norm = inf\n") == "inputs/a.toml:2: optim.clip_grad_norm: inf is not a finite number");
  // The edges are accepted.
  BOOST_CHECK_NO_THROW(Deck::parse("[model]\ndropout = 0.0\n[optim]\nmomentum = 0.0\nbetas = [0, 0.999999]\n", "ok.toml"));
}

BOOST_AUTO_TEST_CASE(bad_choice_and_normalization) {
  BOOST_TEST(problem_of("[fsdp]\nsharding_strategy = \"FULL_SHRD\"\n") ==
             "inputs/a.toml:2: fsdp.sharding_strategy: \"FULL_SHRD\" is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
             "HYBRID_SHARD_ZERO2 (did you mean FULL_SHARD?)");
  BOOST_TEST(problem_of("[optim]\nkind = \"lamb\"\n") == "inputs/a.toml:2: optim.kind: \"lamb\" is not one of sgd, adam, adamw, adadelta");
  BOOST_TEST(problem_of("[fsdp]\nsync_module_states = true\nreshard_after_forward = \"maybe\"\n") ==
             "inputs/a.toml:3: fsdp.reshard_after_forward: \"maybe\" is not one of auto, true, false, node or a group size");
  // A group size: a TOML integer or its digits; at least 2.
  BOOST_TEST(Deck::parse("[fsdp]\nreshard_after_forward = 4\n", "inputs/a.toml").get_string("fsdp.reshard_after_forward") == "4");
  BOOST_TEST(Deck::parse("", "inputs/a.toml", {"fsdp.reshard_after_forward=2"}).get_string("fsdp.reshard_after_forward") == "2");
  BOOST_TEST(problem_of("[fsdp]\nreshard_after_forward = 1\n") == "inputs/a.toml:2: fsdp.reshard_after_forward: 1 is below the minimum group size 2");
  const Deck d = Deck::parse(
      "[fsdp]\nsharding_strategy = \"full_shard\"\nauto_wrap_policy = 'size_based_wrap'\n[optim]\nkind = 'AdamW'\n"
      "[checkpoint]\nstate_dict_type = 'Full_State_Dict'\n[data]\nkind = 'MNIST'\n",
      "n.toml");
  BOOST_TEST(d.get_string("fsdp.sharding_strategy") == "FULL_SHARD");
  BOOST_TEST(d.get_string("fsdp.auto_wrap_policy") == "SIZE_BASED_WRAP");
  BOOST_TEST(d.get_string("optim.kind") == "adamw");
  BOOST_TEST(d.get_string("checkpoint.state_dict_type") == "FULL_STATE_DICT");
  BOOST_TEST(d.get_string("data.kind") == "mnist");
  BOOST_TEST(Deck::parse("", "x", {"fsdp.sharding_strategy=hybrid_shard_zero2"}).get_string("fsdp.sharding_strategy") == "HYBRID_SHARD_ZERO2");
}

BOOST_AUTO_TEST_CASE(every_feature_key_takes_its_values) {
  // Keys of features that once were refused ("not supported yet") all take every value now.
  const Deck d = Deck::parse(
      "[fsdp]\nmixed_precision = 'bf16'\noffload_params = true\nbackward_prefetch = 'backward_pre'\nforward_prefetch = true\n"
      "limit_all_gathers = 2\nactivation_checkpointing = true\nbackend = 'NCCL'\n",
      "ok.toml");
  BOOST_TEST(d.get_string("fsdp.backward_prefetch") == "BACKWARD_PRE");  // choices are normalized
  BOOST_TEST(d.get_string("fsdp.backend") == "nccl");                    // whether a GPU is there is fsdp-train's check
  BOOST_TEST(d.get_bool("fsdp.forward_prefetch"));
  BOOST_TEST(d.get_int("fsdp.limit_all_gathers") == 2);
  BOOST_TEST(starts_with(problem_of("[fsdp]\nbackward_prefetch = 'backward'\n"), "inputs/a.toml:2: fsdp.backward_prefetch: "));
  BOOST_TEST(starts_with(problem_of("[fsdp]\nlimit_all_gathers = -1\n"), "inputs/a.toml:2: fsdp.limit_all_gathers: -1 is below the minimum 0"));
  Deck p;
  BOOST_CHECK_NO_THROW(p.set("fsdp.forward_prefetch", true));
  BOOST_CHECK_NO_THROW(p.set("fsdp.offload_params", true));
}

BOOST_AUTO_TEST_CASE(toml_syntax_error) {
  const auto p = problem_of("[run]\nname = \"x\"\nseed = = 3\n");
  BOOST_TEST(std::regex_search(p, std::regex("^inputs/a\\.toml:3:\\d+: TOML syntax error: ")), p);
  const auto dup = problem_of("[run]\nseed = 1\nseed = 2\n");
  BOOST_TEST(starts_with(dup, "inputs/a.toml:3:"), dup);
  BOOST_TEST(dup.find("seed") != std::string::npos, dup);
  const auto header = problem_of("[run\n");
  BOOST_TEST(starts_with(header, "inputs/a.toml:1:"), header);
  // A syntax error does not hide the problems of the --set options.
  const auto both = problems_of("[run\n", {"optim.lrr=1"});
  BOOST_TEST_REQUIRE(both.size() == 2u);
  BOOST_TEST(both[1] == "--set optim.lrr=1: optim.lrr: unknown key (did you mean optim.lr?)");
}

BOOST_AUTO_TEST_CASE(every_problem_at_once) {
  const std::string text =
      "[optim]\n"              // 1
      "lr = -1\n"              // 2
      "kind = 'lamb'\n"        // 3
      "[data]\n"               // 4
      "batch_size = 'many'\n"  // 5
      "[optimizer]\n"          // 6
      "x = 1\n"                // 7
      "[run]\n"                // 8
      "epochs = 0\n";          // 9
  try {
    Deck::parse(text, "inputs/a.toml", {"run.seed=-3", "log.every=5"});
    BOOST_FAIL("should have thrown");
  } catch (const DeckError& e) {
    const auto& p = e.problems();
    BOOST_TEST_REQUIRE(p.size() == 7u);
    // The deck's problems in line order, then the overrides in order.
    BOOST_TEST(starts_with(p[0], "inputs/a.toml:2: optim.lr:"));
    BOOST_TEST(starts_with(p[1], "inputs/a.toml:3: optim.kind:"));
    BOOST_TEST(starts_with(p[2], "inputs/a.toml:5: data.batch_size: expected an integer"));
    BOOST_TEST(starts_with(p[3], "inputs/a.toml:6: optimizer: unknown section"));
    BOOST_TEST(starts_with(p[4], "inputs/a.toml:9: run.epochs:"));
    BOOST_TEST(p[5] == "--set run.seed=-3: run.seed: -3 is below the minimum 0");
    BOOST_TEST(p[6] == "--set log.every=5: log.every: unknown key (did you mean log.every_steps?)");
    const std::string what = e.what();
    BOOST_TEST(starts_with(what, "[fsdp.deck] 7 problems:\ninputs/a.toml:2: optim.lr:"), what);
    BOOST_TEST(e.id() == "fsdp.deck");
    // One line per problem.
    BOOST_TEST(std::count(what.begin(), what.end(), '\n') == 7);
  }
  // A single problem is the whole message.
  try {
    Deck::parse("[optim]\nlr = -1\n", "inputs/a.toml");
  } catch (const fsdp::ConfigError& e) {
    BOOST_TEST(std::string(e.what()) == "[fsdp.deck] inputs/a.toml:2: optim.lr: -1 must be greater than 0");
  }
}

BOOST_AUTO_TEST_CASE(set_overrides) {
  const Deck d = Deck::parse("[run]\nname = 'deck'\nseed = 5\n[optim]\nlr = 0.5\n", "a.toml",
                             {
                                 "run.name=\"a b\"",                      // quoted TOML string
                                 "run.out_dir=runs/a",                    // unquoted: the bare text
                                 "optim.lr=1e-3",                         // a float
                                 "optim.lr = 2",                          // later wins; an int for a float; spaces
                                 "data.batch_size=32",                    // an int
                                 "optim.betas=[0.8,0.9]",                 // an array
                                 "model.hidden_sizes=[128]",              //
                                 "data.shuffle=false",                    // a bool
                                 "fsdp.sharding_strategy=shard_grad_op",  // unquoted choice, normalized
                                 "fsdp.reshard_after_forward=true",       // a bool for a true/false choice
                                 "checkpoint.resume=runs/a/checkpoints/step_00000100.h5",
                                 "log.metrics_file=",  // empty
                                 "data.path=2024",     // a string key takes the text as written
                             });
  BOOST_TEST(d.get_string("run.name") == "a b");
  BOOST_TEST(d.get_string("run.out_dir") == "runs/a");
  BOOST_TEST(d.get_float("optim.lr") == 2.0);
  BOOST_TEST(d.get_int("data.batch_size") == 32);
  BOOST_TEST((d.get_float_array("optim.betas") == std::vector<double>{0.8, 0.9}));
  BOOST_TEST((d.get_int_array("model.hidden_sizes") == std::vector<std::int64_t>{128}));
  BOOST_TEST(!d.get_bool("data.shuffle"));
  BOOST_TEST(d.get_string("fsdp.sharding_strategy") == "SHARD_GRAD_OP");
  BOOST_TEST(d.get_string("fsdp.reshard_after_forward") == "true");
  BOOST_TEST(d.get_string("checkpoint.resume") == "runs/a/checkpoints/step_00000100.h5");
  BOOST_TEST(d.get_string("log.metrics_file") == "");
  BOOST_TEST(d.get_string("data.path") == "2024");
  BOOST_TEST(d.get_int("run.seed") == 5);
  BOOST_TEST((d.entry("run.seed").source == Source::kDeck));
  BOOST_TEST((d.entry("run.name").source == Source::kSet));
  BOOST_TEST(d.entry("run.name").line == 0);
  BOOST_TEST(d.entry("optim.lr").where == "--set optim.lr = 2");
  BOOST_TEST(d.overrides().size() == 13u);
  BOOST_TEST(d.overrides().front() == "--set run.name=\"a b\"");

  // Errors name the --set text.
  BOOST_TEST(problem_of("", {"optim.lrr=1"}) == "--set optim.lrr=1: optim.lrr: unknown key (did you mean optim.lr?)");
  BOOST_TEST(problem_of("", {"optm.lr=1"}) == "--set optm.lr=1: optm.lr: unknown key (did you mean optim.lr?)");
  BOOST_TEST(problem_of("", {"optim.lr"}) == "--set optim.lr: optim.lr: expected section.key=value");
  BOOST_TEST(problem_of("", {"data.batch_size=abc"}) == "--set data.batch_size=abc: data.batch_size: expected an integer, got a string (\"abc\")");
  BOOST_TEST(problem_of("", {"data.batch_size=0"}) == "--set data.batch_size=0: data.batch_size: 0 is below the minimum 1");
  BOOST_TEST(problem_of("", {"optim.betas=[0.9,2]"}) == "--set optim.betas=[0.9,2]: optim.betas[1]: 2 must be less than 1");
  BOOST_TEST(problem_of("", {"data.shuffle=yes"}) ==
             "--set data.shuffle=yes: data.shuffle: expected a boolean (true or false), got a string (\"yes\")");
  BOOST_TEST(problem_of("", {"fsdp.sharding_strategy=zero3"}).find("is not one of FULL_SHARD") != std::string::npos);
  // apply_overrides: the same rules under another label; the deck is unchanged on failure.
  Deck g = Deck::parse("", "g.toml");
  g.apply_overrides({"optim.lr=0.25", "data.batch_size=16"}, "--grid");
  BOOST_TEST(g.get_float("optim.lr") == 0.25);
  BOOST_TEST(g.entry("data.batch_size").where == "--grid data.batch_size=16");
  try {
    g.apply_overrides({"optim.lr=0.5", "run.epochs=0"}, "--grid");
    BOOST_FAIL("should have thrown");
  } catch (const DeckError& e) {
    BOOST_TEST(e.problems().size() == 1u);
    BOOST_TEST(e.problems()[0] == "--grid run.epochs=0: run.epochs: 0 is below the minimum 1");
  }
  BOOST_TEST(g.get_float("optim.lr") == 0.25);
}

BOOST_AUTO_TEST_CASE(checks_between_keys) {
  BOOST_TEST(problem_of("[model]\nkind = 'transformer'\n") ==
             "inputs/a.toml:2: model.kind: \"transformer\" needs data.kind \"tokens\", \"text\", \"token-shards\" or \"indexed\" (data.kind is "
             "\"fashion-mnist\")");
  BOOST_TEST(problem_of("[data]\nkind = 'tokens'\n") ==
             "inputs/a.toml:2: data.kind: \"tokens\" needs model.kind \"transformer\" or \"llama\" (model.kind is \"cnn\")");
  BOOST_TEST(problem_of("[model]\nkind = 'transformer'\nd_model = 130\n[data]\nkind = 'tokens'\n") ==
             "inputs/a.toml:3: model.d_model: model.n_heads = 4 does not divide model.d_model = 130");
  BOOST_TEST(problem_of("[model]\nkind = 'transformer'\n[data]\nkind = 'text'\n", {"model.n_heads=3"}) ==
             "--set model.n_heads=3: model.n_heads: model.n_heads = 3 does not divide model.d_model = 128");
  BOOST_CHECK_NO_THROW(Deck::parse("[model]\nkind = 'transformer'\n[data]\nkind = 'tokens'\n", "ok.toml"));
  // The image models ignore the transformer's keys.
  BOOST_CHECK_NO_THROW(Deck::parse("[model]\nd_model = 130\n", "ok.toml"));
}

BOOST_AUTO_TEST_CASE(programmatic_set_and_getters) {
  Deck d;
  BOOST_TEST(d.path() == "(defaults)");
  d.set("optim.lr", 0.5);
  BOOST_TEST(d.get_float("optim.lr") == 0.5);
  d.set("optim.lr", std::int64_t{2});  // an int for a float key
  BOOST_TEST(d.get_float("optim.lr") == 2.0);
  d.set("run.name", "x");  // a string literal is a string, not a bool
  BOOST_TEST(d.get_string("run.name") == "x");
  d.set("fsdp.sharding_strategy", std::string("no_shard"));
  BOOST_TEST(d.get_string("fsdp.sharding_strategy") == "NO_SHARD");
  d.set("optim.betas", std::vector<std::int64_t>{0, 0});
  BOOST_TEST((d.get_float_array("optim.betas") == std::vector<double>{0.0, 0.0}));
  d.set("model.dropout", 0.1, Source::kDeck);
  BOOST_TEST(d.is_set("model.dropout"));
  BOOST_TEST((d.entry("model.dropout").source == Source::kDeck));
  d.set("model.dropout", std::monostate{});
  BOOST_TEST(!d.is_set("model.dropout"));
  BOOST_CHECK_THROW(d.set("run.seed", std::monostate{}), DeckError);
  BOOST_CHECK_THROW(d.set("optim.lr", -1.0), DeckError);
  BOOST_CHECK_THROW(d.set("optim.lr", std::string("fast")), DeckError);
  BOOST_CHECK_THROW(d.set("run.epochs", 2.0), DeckError);
  BOOST_CHECK_THROW(d.set("optim.lrr", 1.0), DeckError);
  BOOST_CHECK_THROW(d.set("fsdp.sharding_strategy", std::string("ZERO3")), DeckError);
  // Getters: unknown keys and wrong types are programming errors.
  try {
    (void)d.get_int("optim.lr");
    BOOST_FAIL("should have thrown");
  } catch (const DeckError& e) {
    BOOST_TEST(std::string(e.what()) == "[fsdp.deck] get_int(\"optim.lr\"): optim.lr is a float key, not a integer key");
  }
  try {
    (void)d.get_float("optim.lrr");
    BOOST_FAIL("should have thrown");
  } catch (const DeckError& e) {
    BOOST_TEST(std::string(e.what()).find("did you mean optim.lr?") != std::string::npos, e.what());
  }
  BOOST_CHECK_THROW((void)d.get_string("run.seed"), DeckError);
  BOOST_CHECK_THROW((void)d.get_bool("run.seed"), DeckError);
  BOOST_CHECK_THROW((void)d.get_int_array("optim.betas"), DeckError);
  BOOST_CHECK_THROW((void)d.get_float_array("model.hidden_sizes"), DeckError);
  BOOST_CHECK_THROW((void)d.is_set("nope.nope"), DeckError);
}

BOOST_AUTO_TEST_CASE(from_file) {
  const fs::path dir = fs::temp_directory_path() / ("test_deck_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path file = dir / "a.toml";
  std::ofstream(file) << "[optim]\nlr = 0.125\n";
  const Deck d = Deck::from_file(file.string(), {"run.epochs=3"});
  BOOST_TEST(d.get_float("optim.lr") == 0.125);
  BOOST_TEST(d.get_int("run.epochs") == 3);
  BOOST_TEST(d.path() == file.string());
  std::ofstream(file) << "[optim]\nlr = -1\n";
  try {
    Deck::from_file(file.string());
    BOOST_FAIL("should have thrown");
  } catch (const DeckError& e) {
    BOOST_TEST(e.problems()[0] == file.string() + ":2: optim.lr: -1 must be greater than 0");
  }
  for (const fs::path& bad : {dir / "missing.toml", dir}) {
    try {
      Deck::from_file(bad.string());
      BOOST_FAIL("should have thrown");
    } catch (const DeckError& e) {
      BOOST_TEST(std::string(e.what()).find("cannot read deck '" + bad.string() + "'") != std::string::npos, e.what());
    }
  }
  fsdp::remove_tree(dir);
}

BOOST_AUTO_TEST_CASE(resolved_deck_round_trip) {
  const std::string text =
      "[run]\nname = \"q\\\"uote\\\\ tab\\t ü\"\nseed = 123456789012\nmax_steps = 7\n"
      "[model]\nkind = 'mlp'\ndropout = 0.1\nhidden_sizes = [7]\n"
      "[optim]\nlr = 1e-5\ngamma = 0.3333333333333333\nbetas = [0.1, 0.2]\nweight_decay = 1e+20\n"
      "[fsdp]\nsharding_strategy = 'no_shard'\nreshard_after_forward = true\n"
      "[log]\nmetrics_file = ''\n";
  const Deck d = Deck::parse(text, "inputs/r.toml", {"data.batch_size=3", "checkpoint.dir=/x/y"});
  const std::string toml = d.to_toml();
  BOOST_TEST(toml.find("# Override: --set data.batch_size=3") != std::string::npos, toml);
  const Deck again = Deck::parse(toml, "resolved.toml");
  for (std::size_t i = 0; i < d.entries().size(); ++i) {
    const Entry& a = d.entries()[i];
    const Entry& b = again.entries()[i];
    BOOST_TEST_CONTEXT(a.spec->key) {
      BOOST_TEST((a.value == b.value), format_value(a.value) << " vs " << format_value(b.value));
      BOOST_TEST((b.source == Source::kDeck));
    }
  }
  BOOST_TEST(again.get_string("run.name") == "q\"uote\\ tab\t ü");
  BOOST_TEST(again.get_float("optim.gamma") == 1.0 / 3.0);
  BOOST_TEST(again.get_float("optim.lr") == 1e-5);
  BOOST_TEST(again.to_toml().find("[run]") != std::string::npos);

  // Unset keys are comments, and stay unset.
  const Deck defaults;
  const std::string dt = defaults.to_toml();
  BOOST_TEST(dt.find("\n# dropout = (unset)\n") != std::string::npos, dt);
  BOOST_TEST(dt.find("\nlr = 1.0\n") != std::string::npos, dt);
  const Deck back = Deck::parse(dt, "resolved.toml");
  BOOST_TEST(!back.is_set("model.dropout"));
  for (std::size_t i = 0; i < back.entries().size(); ++i) BOOST_TEST((back.entries()[i].value == defaults.entries()[i].value));
  // Sections in schema order.
  std::size_t last = 0;
  for (const auto& s : deck_sections()) {
    const auto at = dt.find("\n[" + s + "]\n");
    BOOST_TEST_REQUIRE(at != std::string::npos);
    BOOST_TEST(at > last);
    last = at;
  }
}

BOOST_AUTO_TEST_CASE(echo_table) {
  const Deck d = Deck::parse("[optim]\nlr = 0.5\n", "a.toml", {"run.epochs=4"});
  const std::string table = d.echo_table();
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);
  const auto value_column = line.find("value");
  const auto source_column = line.find("source");
  BOOST_TEST(line.rfind("key", 0) == 0u);
  std::size_t rows = 0;
  std::map<std::string, std::string> source_of;
  std::getline(lines, line);  // the rule
  while (std::getline(lines, line)) {
    ++rows;
    const std::string key = line.substr(0, line.find(' '));
    BOOST_TEST(line[value_column - 1] == ' ');
    BOOST_TEST(line[value_column] != ' ', line);
    source_of[key] = line.substr(source_column);
  }
  BOOST_TEST(rows == deck_schema().size());
  BOOST_TEST(source_of["optim.lr"] == "deck");
  BOOST_TEST(source_of["run.epochs"] == "--set");
  BOOST_TEST(source_of["run.seed"] == "default");
  BOOST_TEST(table.find("model.dropout") != std::string::npos);
  BOOST_TEST(table.find("(unset)") != std::string::npos);
  BOOST_TEST(format_value(std::monostate{}) == "(unset)");
  BOOST_TEST(format_value(Value{std::vector<double>{1, 0.5}}) == "[1.0, 0.5]");
}

BOOST_AUTO_TEST_CASE(reference_doc_matches_the_schema) {
  const std::string path = std::string(FSDP_DOCS_DIR) + "/deck_reference.md";
  std::ifstream in(path, std::ios::binary);
  BOOST_TEST_REQUIRE(static_cast<bool>(in), "cannot read " << path);
  std::ostringstream text;
  text << in.rdbuf();
  const std::string expected = reference_markdown();
  BOOST_TEST((text.str() == expected), path << " is out of date with the schema in app/deck.cpp; regenerate it with\n"
                                               "  build/bin/fsdp-sweep --print-reference > docs/deck_reference.md");
  for (const auto& s : deck_schema()) BOOST_TEST(expected.find("| `" + s.name() + "` |") != std::string::npos, s.key);
}

// ---- the deck resolved for a placement (run_config.hpp) -------------------------------------------

namespace {
Placement placement_of(int world, int per_node, int node_cores = 8, int rank_cpus = 8) {
  Placement p;
  p.world_size = world;
  p.ranks_per_node = per_node;
  p.nodes = (world + per_node - 1) / per_node;
  p.node_cores = node_cores;
  p.rank_cpus = rank_cpus;
  return p;
}
}  // namespace

BOOST_AUTO_TEST_CASE(resolved_config_carries_comm_timeout_to_the_checkpoints) {
  const auto deck = Deck::parse("[comm]\ntimeout_s = 30\n", "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(4, 2));
  BOOST_TEST(cfg.comm.timeout_s == 30.0);
  BOOST_TEST(cfg.checkpoint.collective_timeout_s == 30.0);
  const auto defaults = resolve_run_config(Deck(), placement_of(1, 1));
  BOOST_TEST(defaults.checkpoint.collective_timeout_s == defaults.comm.timeout_s);
}

BOOST_AUTO_TEST_CASE(resolved_config_decides_the_autos) {
  // run.threads = 0: the node's cores over its ranks; out_dir and checkpoint dir from run.name.
  const auto deck = Deck::parse("[run]\nname = \"x\"\n[fsdp]\nsharding_strategy = \"HYBRID_SHARD\"\n", "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(4, 2, 8, 8));
  BOOST_TEST(cfg.run.threads == 4);
  // ... and no more than the CPUs the rank may run on (mpirun binds a rank to one core by default).
  BOOST_TEST(resolve_run_config(deck, placement_of(4, 2, 8, 1)).run.threads == 1);
  BOOST_TEST(resolve_run_config(deck, placement_of(4, 2, 8, 3)).run.threads == 3);
  BOOST_TEST(cfg.run.out_dir == "runs/x");
  BOOST_TEST(cfg.checkpoint.dir == "runs/x/checkpoints");
  BOOST_TEST(cfg.fsdp.shard_group_size == 2);  // the ranks of one node
  BOOST_TEST(cfg.fsdp.reshard_after_forward == fsdp::reshard_after_forward_default(fsdp::ShardingStrategy::HYBRID_SHARD));
  BOOST_TEST(cfg.fsdp.sharding_strategy == fsdp::ShardingStrategy::HYBRID_SHARD);
  // overlap_grad_reduce = auto: a spare core per rank (4 threads on 8 CPUs but 2 x 4 = 8 cores used: no).
  BOOST_TEST(!cfg.fsdp.overlap_grad_reduce);
  const auto spare = resolve_run_config(Deck::parse("[run]\nthreads = 2\n", "inputs/a.toml", {}), placement_of(2, 2, 8, 8));
  BOOST_TEST(spare.fsdp.overlap_grad_reduce);
  BOOST_TEST(spare.fsdp.shard_group_size == 2);
  // backward_prefetch = auto follows the same rule (its all-gathers run on the same worker); a value
  // given is kept.
  BOOST_TEST(cfg.fsdp.backward_prefetch_name == "NO_PREFETCH");
  BOOST_TEST(spare.fsdp.backward_prefetch_name == "BACKWARD_PRE");
  const auto asked =
      resolve_run_config(Deck::parse("[fsdp]\nbackward_prefetch = \"BACKWARD_POST\"\n", "inputs/a.toml", {}), placement_of(4, 2, 8, 8));
  BOOST_TEST(asked.fsdp.backward_prefetch_name == "BACKWARD_POST");
  // On NCCL both overlaps are the GPU's streams (no worker thread): auto turns them on without a
  // spare core; a value given is kept.
  auto gpu_node = placement_of(4, 2, 8, 8);
  gpu_node.gpu = Placement::Gpu{.usable = true, .why_not = "", .built_with_nccl = true};
  const auto on_gpu = resolve_run_config(deck, gpu_node);
  BOOST_TEST((on_gpu.fsdp.backend_resolved == Backend::kNccl));
  BOOST_TEST(on_gpu.fsdp.overlap_grad_reduce);
  BOOST_TEST(on_gpu.fsdp.backward_prefetch_name == "BACKWARD_PRE");
  const auto off_on_gpu =
      resolve_run_config(Deck::parse("[fsdp]\noverlap_grad_reduce = false\nbackward_prefetch = \"NO_PREFETCH\"\n", "inputs/a.toml", {}), gpu_node);
  BOOST_TEST(!off_on_gpu.fsdp.overlap_grad_reduce);
  BOOST_TEST(off_on_gpu.fsdp.backward_prefetch_name == "NO_PREFETCH");
}

BOOST_AUTO_TEST_CASE(auto_layer_classes_give_untied_embeddings_units_of_their_own) {
  const auto classes = [](const std::string& deck_text) {
    const std::string data = deck_text.find("transformer") != std::string::npos ? "[data]\nkind = \"tokens\"\n" : "";
    return resolve_run_config(Deck::parse(data + deck_text, "inputs/a.toml", {}), placement_of(1, 1)).fsdp.transformer_layer_cls_to_wrap;
  };
  using Names = std::vector<std::string>;
  BOOST_TEST((classes("[model]\nkind = \"transformer\"\n") == Names{"TransformerBlock"}));  // tied: one matrix, in the root
  BOOST_TEST((classes("[model]\nkind = \"transformer\"\ntie_embeddings = false\n") == Names{"TransformerBlock", "Embedding", "LmHead"}));
  BOOST_TEST(classes("[model]\nkind = \"mlp\"\n").empty());  // no repeated layer to name
  // TRANSFORMER_BASED_WRAP with no type to wrap: "auto" of a model without layers, or an empty name.
  const auto refusal = [](const std::string& deck_text) -> std::string {
    try {
      resolve_run_config(Deck::parse(deck_text, "inputs/a.toml", {}), placement_of(1, 1));
    } catch (const DeckError& e) {
      return fsdp::message_without_id(e);
    }
    return "(accepted)";
  };
  BOOST_TEST(refusal("[model]\nkind = \"mlp\"\n[fsdp]\nauto_wrap_policy = \"TRANSFORMER_BASED_WRAP\"\n") ==
             "inputs/a.toml: fsdp.transformer_layer_cls_to_wrap: \"auto\" names no layer for model.kind = \"mlp\": TRANSFORMER_BASED_WRAP wraps "
             "the module types named here; name them, or use fsdp.auto_wrap_policy = \"SIZE_BASED_WRAP\"");
  BOOST_TEST(refusal("[fsdp]\nauto_wrap_policy = \"TRANSFORMER_BASED_WRAP\"\ntransformer_layer_cls_to_wrap = []\n") ==
             "inputs/a.toml:3: fsdp.transformer_layer_cls_to_wrap: names no module type: TRANSFORMER_BASED_WRAP wraps the module types named "
             "here; name them, or use fsdp.auto_wrap_policy = \"SIZE_BASED_WRAP\"");
  BOOST_TEST((classes("[model]\nkind = \"transformer\"\ntie_embeddings = false\n[fsdp]\ntransformer_layer_cls_to_wrap = \"TransformerBlock\"\n") ==
              Names{"TransformerBlock"}));
}

BOOST_AUTO_TEST_CASE(resolved_config_names_a_shard_group_that_does_not_divide_the_world) {
  const auto deck = Deck::parse("[fsdp]\nsharding_strategy = \"HYBRID_SHARD\"\nshard_group_size = 3\n", "inputs/a.toml", {});
  try {
    resolve_run_config(deck, placement_of(4, 4));
    BOOST_FAIL("a shard group of 3 in a world of 4 resolved");
  } catch (const DeckError& e) {
    BOOST_TEST(std::string(e.what()).find("inputs/a.toml:3: fsdp.shard_group_size: 3 does not divide the world size 4") != std::string::npos,
               e.what());
  }
}

BOOST_AUTO_TEST_CASE(a_group_size_for_a_strategy_that_takes_none_follows_the_cores_rule) {
  // The core's rule (shard_group_size()): FULL_SHARD's shard group is the world, so the world size
  // itself is accepted and any other size refused, named by its key; the deck alone says nothing.
  const auto deck = Deck::parse("[fsdp]\nsharding_strategy = \"FULL_SHARD\"\nshard_group_size = 2\n", "inputs/a.toml", {});
  BOOST_TEST(resolve_run_config(deck, placement_of(2, 2)).fsdp.shard_group_size == 2);
  try {
    resolve_run_config(deck, placement_of(4, 4));
    BOOST_FAIL("FULL_SHARD with a shard group of 2 in a world of 4 resolved");
  } catch (const DeckError& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("inputs/a.toml:3: fsdp.shard_group_size:") != std::string::npos, what);
    BOOST_TEST(what.find("applies to the hybrid strategies only (strategy is FULL_SHARD)") != std::string::npos, what);
  }
}

BOOST_AUTO_TEST_CASE(resolved_config_splits_the_layer_classes) {
  const auto deck = Deck::parse("[fsdp]\ntransformer_layer_cls_to_wrap = \"A, B ,C\"\n", "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(1, 1));
  BOOST_TEST((cfg.fsdp.transformer_layer_cls_to_wrap == std::vector<std::string>{"A", "B", "C"}));
  BOOST_TEST(cfg.fsdp.transformer_layer_cls_where == "inputs/a.toml:2");
}

BOOST_AUTO_TEST_CASE(layer_classes_as_a_toml_array) {
  const auto deck =
      Deck::parse("[fsdp]\nauto_wrap_policy = \"TRANSFORMER_BASED_WRAP\"\ntransformer_layer_cls_to_wrap = [\"TransformerBlock\", \"Other\"]\n",
                  "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(1, 1));
  BOOST_TEST((cfg.fsdp.transformer_layer_cls_to_wrap == std::vector<std::string>{"TransformerBlock", "Other"}));
  BOOST_TEST(cfg.fsdp.transformer_layer_cls_where == "inputs/a.toml:3");
  // The resolved deck writes it back as the comma-separated string, which parses to the same names.
  const auto again = resolve_run_config(Deck::parse(deck.to_toml(), "deck.toml", {}), placement_of(1, 1));
  BOOST_TEST((again.fsdp.transformer_layer_cls_to_wrap == cfg.fsdp.transformer_layer_cls_to_wrap));
  // --set takes the array too.
  const auto set = Deck::parse("", "inputs/a.toml", {"fsdp.transformer_layer_cls_to_wrap=[\"A\", \"B\"]"});
  BOOST_TEST((resolve_run_config(set, placement_of(1, 1)).fsdp.transformer_layer_cls_to_wrap == std::vector<std::string>{"A", "B"}));
  // Elements must be strings.
  BOOST_TEST(problem_of("[fsdp]\ntransformer_layer_cls_to_wrap = [\"A\", 2]\n") ==
             "inputs/a.toml:2: fsdp.transformer_layer_cls_to_wrap[1]: expected a string, got an integer (2)");
  // Every name must be a type of the model, with the model's types in the message, as for the string.
  check_wrap_classes(cfg.fsdp, {"Gpt", "Other", "TransformerBlock"});
  for (const auto& names : {std::string("[\"TransformerBlok\", \"Other\"]"), std::string("\"TransformerBlok, Other\"")}) {
    const auto bad = resolve_run_config(
        Deck::parse("[fsdp]\nauto_wrap_policy = \"TRANSFORMER_BASED_WRAP\"\ntransformer_layer_cls_to_wrap = " + names + "\n", "inputs/a.toml", {}),
        placement_of(1, 1));
    try {
      check_wrap_classes(bad.fsdp, {"Gpt", "Other", "TransformerBlock"});
      BOOST_FAIL("an unknown layer class passed");
    } catch (const DeckError& e) {
      BOOST_TEST(std::string(e.what()) ==
                 "[fsdp.deck] inputs/a.toml:3: fsdp.transformer_layer_cls_to_wrap: the model has no module of type \"TransformerBlok\" (its types: "
                 "Gpt, Other, TransformerBlock)");
    }
  }
}

BOOST_AUTO_TEST_CASE(a_global_batch_splits_into_micro_batches_for_each_world_size) {
  // The fewest micro-batches of at most max_micro samples that divide a rank's share.
  auto split = [](std::int64_t global, int world, std::int64_t micro) {
    const auto s = split_global_batch(global, world, micro);
    return s ? std::to_string(s->micro) + "x" + std::to_string(s->accum) : std::string("none");
  };
  BOOST_TEST(split(12, 4, 2) == "1x3");
  BOOST_TEST(split(12, 3, 2) == "2x2");
  BOOST_TEST(split(12, 2, 2) == "2x3");
  BOOST_TEST(split(64, 4, 16) == "16x1");
  BOOST_TEST(split(64, 2, 16) == "16x2");
  BOOST_TEST(split(14, 2, 3) == "1x7");  // 7 samples per rank: no micro-batch of 2 or 3 divides them
  BOOST_TEST(split(12, 5, 2) == "none");
  BOOST_TEST(split(0, 1, 2) == "none");
  // Resolved into data.batch_size and optim.grad_accum_steps.
  const auto deck = Deck::parse("[data]\nbatch_size = 2\nglobal_batch_size = 12\n", "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(3, 3));
  BOOST_TEST(cfg.data.batch_size == 2);
  BOOST_TEST(cfg.optim.grad_accum_steps == 2);
  BOOST_TEST(cfg.data.global_batch_size == 12);
}

#include "train/schedule.hpp"

BOOST_AUTO_TEST_CASE(learning_rate_schedules_with_warmup_and_floor) {
  auto cfg_of = [](const std::string& text) { return resolve_run_config(Deck::parse(text, "inputs/a.toml", {}), placement_of(1, 1)); };
  // Warmup 2 then cosine from 1.0 to the floor 0.1 over steps 2..11 (the last step reaches the floor).
  const auto cosine = cfg_of("[optim]\nkind = \"adamw\"\nlr = 1.0\nlr_min = 0.1\nschedule = \"cosine\"\nwarmup_steps = 2\n");
  BOOST_TEST(lr_at(cosine, 0, 0, 12) == 0.5);
  BOOST_TEST(lr_at(cosine, 1, 0, 12) == 1.0);
  BOOST_TEST(lr_at(cosine, 2, 0, 12) == 1.0);
  BOOST_TEST(std::abs(lr_at(cosine, 11, 0, 12) - 0.1) < 1e-12);
  BOOST_TEST(std::abs(lr_at(cosine, 6, 0, 12) - (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 4.0 / 9.0)))) < 1e-12);
  // wsd: stable at 1.0, then the last 20% (2 of 10 steps) linearly down to 0.1.
  const auto wsd = cfg_of("[optim]\nkind = \"adamw\"\nlr = 1.0\nlr_min = 0.1\nschedule = \"wsd\"\nwarmup_steps = 1\ndecay_fraction = 0.2\n");
  BOOST_TEST(lr_at(wsd, 0, 0, 10) == 1.0);  // warmup of one step: 1.0 x 1/1
  BOOST_TEST(lr_at(wsd, 7, 0, 10) == 1.0);
  BOOST_TEST(std::abs(lr_at(wsd, 8, 0, 10) - 0.55) < 1e-12);
  BOOST_TEST(std::abs(lr_at(wsd, 9, 0, 10) - 0.1) < 1e-12);
  // step: gamma per epoch, not below the floor.
  const auto step = cfg_of("[optim]\nlr = 1.0\nlr_min = 0.4\nschedule = \"step\"\ngamma = 0.5\n");
  BOOST_TEST(lr_at(step, 0, 1, 100) == 0.5);
  BOOST_TEST(lr_at(step, 0, 2, 100) == 0.4);
  // Checks between the keys (made when the deck is resolved).
  auto resolve_error = [&](const std::string& text) {
    try {
      cfg_of(text);
    } catch (const DeckError& e) {
      return std::string(e.what());
    }
    return std::string("(resolved)");
  };
  BOOST_TEST(resolve_error("[optim]\nlr = 0.1\nlr_min = 0.1\nschedule = \"cosine\"\n").find("optim.lr_min: 0.100000 must be below optim.lr") !=
             std::string::npos);
  BOOST_TEST(resolve_error("[optim]\nkind = \"adam\"\nno_decay = [\"bias\"]\n").find("optim.no_decay: takes parameters out of adamw") !=
             std::string::npos);
  BOOST_TEST(resolve_error("[optim]\nkind = \"adamw\"\nno_decay = [\"bias\", \"gain\"]\n").find("'gain' is not one of bias, norm, embedding") !=
             std::string::npos);
  BOOST_TEST((cfg_of("[optim]\nkind = \"adamw\"\nno_decay = [\"bias\", \"norm\"]\n").optim.no_decay == std::vector<std::string>{"bias", "norm"}));
}

#include "plan/fit_check.hpp"

namespace {
/// A fake /proc and /sys/fs/cgroup under `root`.
void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}
}  // namespace

BOOST_AUTO_TEST_CASE(memory_limits_from_cgroups_slurm_and_meminfo) {
  const fs::path root = fs::temp_directory_path() / ("fsdp_memlimit_" + std::to_string(::getpid()));
  fsdp::remove_tree(root);
  std::map<std::string, std::string> env;
  fsdp::app::MemoryProbe probe{root / "proc", root / "cgroup", [&](const char* k) { return env.count(k) ? env[k].c_str() : nullptr; }};
  // cgroup v2: the job's cgroup is limited, its step's is not ("max"); the smaller of the path counts.
  write_file(root / "proc/self/cgroup", "0::/job_7/step_0\n");
  write_file(root / "cgroup/job_7/memory.max", "8589934592\n");
  write_file(root / "cgroup/job_7/step_0/memory.max", "max\n");
  write_file(root / "proc/meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n");
  auto limits = fsdp::app::memory_limits(probe);
  BOOST_REQUIRE(limits.size() == 2u);
  BOOST_TEST(limits[0].bytes == 8589934592LL);
  BOOST_TEST(limits[0].source.find("cgroup v2 limit") == 0u, limits[0].source);
  BOOST_TEST(limits[0].source.find("job_7/memory.max") != std::string::npos, limits[0].source);
  BOOST_TEST(limits[1].bytes == 20000000LL * 1024);
  // Slurm: --mem per node, --mem-per-cpu times the node's CPUs; the tightest wins.
  env = {{"SLURM_MEM_PER_NODE", "4096"}};
  BOOST_TEST(fsdp::app::tightest(fsdp::app::memory_limits(probe))->source == "Slurm --mem (SLURM_MEM_PER_NODE=4096 MiB)");
  env = {{"SLURM_MEM_PER_CPU", "1000"}, {"SLURM_CPUS_ON_NODE", "3"}};
  const auto per_cpu = fsdp::app::tightest(fsdp::app::memory_limits(probe));
  BOOST_TEST(per_cpu->bytes == 3000LL << 20);
  BOOST_TEST(per_cpu->source.find("SLURM_MEM_PER_CPU=1000 MiB x 3 CPUs") != std::string::npos, per_cpu->source);
  env = {{"SLURM_MEM_PER_NODE", "lots"}};  // not a number: ignored
  BOOST_TEST(fsdp::app::memory_limits(probe).size() == 2u);
  // Past 2^40 MiB (2^60 bytes) no limit, as for cgroups: shifted into bytes it wrapped to -1 or 0 MiB.
  for (const auto& big : std::vector<std::map<std::string, std::string>>{{{"SLURM_MEM_PER_NODE", "9223372036854775807"}},
                                                                         {{"SLURM_MEM_PER_NODE", "17592186044416"}},
                                                                         {{"SLURM_MEM_PER_CPU", "4398046511104"}, {"SLURM_CPUS_ON_NODE", "4"}}}) {
    env = big;
    BOOST_TEST(fsdp::app::memory_limits(probe).size() == 2u, big.begin()->second);
  }
  // cgroup v1 (the memory controller among others), with the unlimited sentinel at the top.
  write_file(root / "proc/self/cgroup", "5:cpuacct,memory:/slurm/uid_0/job_9\n2:cpu:/\n");
  write_file(root / "cgroup/memory/slurm/uid_0/job_9/memory.limit_in_bytes", "1073741824\n");
  write_file(root / "cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  env.clear();
  limits = fsdp::app::memory_limits(probe);
  BOOST_TEST(limits[0].bytes == 1073741824LL);
  BOOST_TEST(limits[0].source.find("cgroup v1 limit") == 0u, limits[0].source);
  fsdp::remove_tree(root);
}

BOOST_AUTO_TEST_CASE(a_run_that_does_not_fit_is_told_what_would) {
  const auto deck = Deck::parse(
      "[model]\nkind = \"transformer\"\nd_model = 512\nn_layers = 8\n[data]\nkind = \"tokens\"\nbatch_size = 32\n"
      "[fsdp]\nsharding_strategy = \"NO_SHARD\"\n",
      "inputs/a.toml", {});
  const auto cfg = resolve_run_config(deck, placement_of(2, 2));
  const auto roomy = fsdp::app::check_memory_fit(deck, cfg, {{std::int64_t{64} << 30, "test"}});
  BOOST_TEST(roomy.fits);
  BOOST_TEST(roomy.per_node == 2 * roomy.per_rank);
  BOOST_TEST(fsdp::app::check_memory_fit(deck, cfg, {}).fits);  // no limit known: no refusal
  // A budget just below the prediction: refused, with suggestions that the model says fit.
  const fsdp::app::MemoryLimit tight{roomy.per_node - (std::int64_t{8} << 20), "test budget"};
  const auto v = fsdp::app::check_memory_fit(deck, cfg, {tight});
  BOOST_TEST(!v.fits);
  BOOST_TEST(!v.suggestions.empty());
  const auto text = fsdp::app::fit_refusal(v, 2);
  BOOST_TEST(text.find("the run will not fit in memory: predicted peak") == 0u, text);
  BOOST_TEST(text.find("limit ") != std::string::npos, text);
  BOOST_TEST(text.find("(test budget)") != std::string::npos, text);
  BOOST_TEST(text.find("fsdp.sharding_strategy = \"FULL_SHARD\"") != std::string::npos, text);  // sharding the state saves its copies
  BOOST_TEST(text.find("data.batch_size = ") != std::string::npos, text);
}

// No number, however large, crashes a program: every size key has a maximum, a number past 64 bits is
// said to be one (not "a string"), and a model or batch past what can be addressed is refused by key
// before any 64-bit arithmetic (fsdp-plan crashed in its memory planner on data.batch_size = 2^62).
BOOST_AUTO_TEST_CASE(huge_numbers_are_refused_by_key_before_any_arithmetic) {
  BOOST_TEST(problem_of("", {"data.batch_size=4611686018427387904"}) ==
             "--set data.batch_size=4611686018427387904: data.batch_size: 4611686018427387904 is above the maximum 100000000");
  BOOST_TEST(problem_of("", {"data.batch_size=46116860184273879040"}) ==
             "--set data.batch_size=46116860184273879040: data.batch_size: 46116860184273879040: a number too large for a 64-bit integer (at most "
             "100000000 here)");
  BOOST_TEST(starts_with(problem_of("", {"model.hidden_sizes=[12, 46116860184273879040]"}),
                         "--set model.hidden_sizes=[12, 46116860184273879040]: model.hidden_sizes: [12, 46116860184273879040]: a number too large"));
  BOOST_TEST(problem_of("[model]\nhidden_sizes = [4.6e18]\n") ==
             "inputs/a.toml:2: model.hidden_sizes[0]: expected an integer, got a float (4.6e+18)");
  for (const auto& s : deck_schema())
    if (s.type == KeyType::kInt && s.key != "run.seed") BOOST_TEST(s.max.has_value(), s.key << " has no maximum");
  auto resolve_error = [](const std::string& text) -> std::string {
    try {
      resolve_run_config(Deck::parse(text, "inputs/a.toml", {}), Placement{});
    } catch (const DeckError& e) {
      return e.what();
    }
    return "";
  };
  auto gpt = [](const std::string& model, const std::string& data) {
    return "[model]\nkind = \"transformer\"\n" + model + "[data]\nkind = \"tokens\"\n" + data;
  };
  const auto model = resolve_error(gpt("d_model = 1000000\nn_layers = 100000\n", ""));
  BOOST_TEST(model.find("inputs/a.toml: [model]: the deck's transformer has about 1.2e+18 parameters") != std::string::npos, model);
  BOOST_TEST(model.find("more than the 2^60 bytes") != std::string::npos, model);
  const auto batch = resolve_error(gpt("context = 10000000\n", "batch_size = 100000\n"));
  BOOST_TEST(batch.find("inputs/a.toml:6: data.batch_size: 100000 (data.test_batch_size 1000) with this model needs about") != std::string::npos,
             batch);
  BOOST_TEST(resolve_error(gpt("", "")).empty());
}

namespace {
/// A folder holding `config` as config.json, fresh for each test.
std::string hf_folder(const std::string& name, const std::string& config) {
  const fs::path dir = fs::temp_directory_path() / ("fsdp_test_deck_hf_" + std::to_string(::getpid())) / name;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config;
  return dir.string();
}
const char* kSmolLm2Config = R"({"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
  "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 100000, "tie_word_embeddings": true, "vocab_size": 49152, "attention_bias": false, "mlp_bias": false,
  "bos_token_id": 0, "eos_token_id": 0})";
}  // namespace

BOOST_AUTO_TEST_CASE(a_resume_compares_what_decides_the_training_only) {
  // Stored decks of earlier versions hold eos_token_id = -1 (now []); what only an export or
  // generation reads, and attention's recomputation (the same bits), do not stop a resume.
  const std::string llama = "[model]\nkind = 'llama'\n";
  const Deck stored =
      Deck::parse(llama + "eos_token_id = -1\nbos_token_id = -1\nmax_positions = 0\nsliding_window = 0\n[data]\nkind = 'tokens'\n", "stored.toml");
  const Deck now = Deck::parse(llama +
                                   "eos_token_id = [1, 2]\nbos_token_id = 3\nmax_positions = 8192\nsliding_window = 4096\n"
                                   "recompute_attention = false\n[data]\nkind = 'tokens'\n",
                               "now.toml");
  BOOST_TEST(trajectory_changes(stored, now).empty());
  const auto changes = trajectory_changes(stored, Deck::parse(llama + "rope_theta = 500000.0\n[data]\nkind = 'tokens'\n", "theta.toml"));
  BOOST_TEST_REQUIRE(changes.size() == 1u);
  BOOST_TEST(changes[0].key == "model.rope_theta");
}

BOOST_AUTO_TEST_CASE(a_hugging_face_config_sets_the_model_and_says_so) {
  const auto smol = hf_folder("smol", kSmolLm2Config);
  const Deck d = Deck::parse("[model]\nhf_config = '" + smol + "'\ncontext = 256\n[data]\nkind = 'tokens'\n", "a.toml");
  const ModelSection m = resolve_model_section(d);
  BOOST_TEST((m.kind == ModelKind::kLlama));
  BOOST_TEST(m.d_model == 576);
  BOOST_TEST(m.n_layers == 30);
  BOOST_TEST(m.n_heads == 9);
  BOOST_TEST(m.n_kv_heads == 3);
  BOOST_TEST(m.head_dim == 64);  // hidden_size / num_attention_heads, set so that a deck's other value contradicts
  BOOST_TEST(m.intermediate_size == 1536);
  BOOST_TEST(m.vocab_size == 49152);
  BOOST_TEST(m.rope_theta == 100000.0);
  BOOST_TEST(m.tie_embeddings);
  BOOST_TEST(m.context == 256);         // the deck's: a rotary model's context is the run's choice
  BOOST_TEST(m.max_positions == 8192);  // kept for the export's config.json
  BOOST_TEST((m.eos_token_ids == std::vector<std::int64_t>{0}));
  BOOST_TEST((d.entry("model.d_model").source == Source::kHfConfig));
  BOOST_TEST(d.entry("model.d_model").where == smol + "/config.json: hidden_size");
  BOOST_TEST(std::regex_search(d.echo_table(), std::regex(R"(model\.d_model +576 +hf_config)")));
  // The stored deck stands alone: hf_config a comment, its values written out; a resume compares sizes.
  const std::string toml = d.to_toml();
  BOOST_TEST(toml.find("# hf_config = ") != std::string::npos);
  const Deck again = Deck::parse(toml, "stored.toml");
  BOOST_TEST(again.get_int("model.d_model") == 576);
  BOOST_TEST(trajectory_changes(again, d).empty());
  // The same value in the deck is no contradiction; another is, naming both.
  BOOST_CHECK_NO_THROW(Deck::parse("[model]\nhf_config = '" + smol + "'\nd_model = 576\n[data]\nkind = 'tokens'\n", "a.toml"));
  const auto p = problem_of("[model]\nhf_config = '" + smol + "'\nn_heads = 8\n[data]\nkind = 'tokens'\n");
  BOOST_TEST(p.find("inputs/a.toml:3: model.n_heads: 8 contradicts num_attention_heads = 9 in " + smol + "/config.json") == 0u, p);
  BOOST_TEST(
      problem_of("[model]\nhf_config = '" + smol + "'\ncontext = 9000\n[data]\nkind = 'tokens'\n").find("is beyond model.max_positions = 8192 (") !=
      std::string::npos);
  // A --set of another config replaces every value of the first.
  const auto gpt2 = hf_folder("gpt2", R"({"architectures": ["GPT2LMHeadModel"], "n_positions": 1024, "n_embd": 768, "n_layer": 12,
    "n_head": 12, "n_inner": null, "activation_function": "gelu_new", "vocab_size": 50257})");
  Deck e = Deck::parse("[model]\nhf_config = '" + smol + "'\n[data]\nkind = 'tokens'\n", "a.toml");
  e.apply_overrides({"model.hf_config=" + gpt2});
  const ModelSection g = resolve_model_section(e);
  BOOST_TEST((g.kind == ModelKind::kTransformer));
  BOOST_TEST(g.context == 1024);  // learned positions: n_positions rows
  BOOST_TEST(g.mlp_ratio == 4);
  BOOST_TEST((g.activation == Activation::kGeluTanh));
  BOOST_TEST(g.tie_embeddings);  // GPT-2's default
  BOOST_TEST((e.entry("model.n_kv_heads").source == Source::kDefault));
}

BOOST_AUTO_TEST_CASE(end_tokens_are_one_id_or_a_list_in_the_deck_config_json_and_export) {
  // Llama 3.1's instruct models end a turn at any of three tokens: all three are kept, and written back.
  const std::string llama31 = hf_folder("llama31", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 128256, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009]})");
  const ModelSection m = resolve_model_section(Deck::parse("[model]\nhf_config = '" + llama31 + "'\n[data]\nkind = 'tokens'\n", "a.toml"));
  BOOST_TEST((m.eos_token_ids == std::vector<std::int64_t>{128001, 128008, 128009}));
  BOOST_TEST(m.bos_token_id == 128000);
  BOOST_TEST(hf_llama_config(LlamaConfig::of(m)).at("eos_token_id").dump() == "[128001,128008,128009]");
  // One id stays a number in the deck's stored form and in the export; -1 and [] are none.
  auto ids = [](const std::string& deck, const std::vector<std::string>& sets = {}) {
    return resolve_model_section(Deck::parse("[model]\nkind = 'llama'\n" + deck + "[data]\nkind = 'tokens'\n", "b.toml", sets)).eos_token_ids;
  };
  BOOST_TEST((ids("eos_token_id = 2\n") == std::vector<std::int64_t>{2}));
  BOOST_TEST(hf_llama_config(LlamaConfig::of(resolve_model_section(
                                 Deck::parse("[model]\nkind = 'llama'\neos_token_id = 2\n[data]\nkind = 'tokens'\n", "c.toml"))))
                 .at("eos_token_id")
                 .dump() == "2");
  BOOST_TEST((ids("eos_token_id = [2, 7]\n") == std::vector<std::int64_t>{2, 7}));
  BOOST_TEST((ids("", {"model.eos_token_id=[3,4]"}) == std::vector<std::int64_t>{3, 4}));
  BOOST_TEST((ids("", {"model.eos_token_id=5"}) == std::vector<std::int64_t>{5}));
  BOOST_TEST(ids("eos_token_id = -1\n").empty());  // the stored decks of earlier versions
  BOOST_TEST(ids("").empty());
  BOOST_TEST(!hf_llama_config(LlamaConfig::of(resolve_model_section(Deck::parse("[model]\nkind = 'llama'\n[data]\nkind = 'tokens'\n", "d.toml"))))
                  .contains("eos_token_id"));
  BOOST_TEST(problem_of("[model]\nkind = 'llama'\neos_token_id = [2, -5]\n[data]\nkind = 'tokens'\n")
                 .find("model.eos_token_id[1]: -5 is below the minimum -1") != std::string::npos);
  BOOST_TEST(problem_of("[model]\nkind = 'llama'\neos_token_id = 'x'\n[data]\nkind = 'tokens'\n").find("model.eos_token_id") != std::string::npos);
  // A list that is not of token ids is refused, naming the file and key.
  const std::string bad = hf_folder("bad_eos", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "eos_token_id": [1, "x"]})");
  BOOST_TEST(problem_of("[model]\nhf_config = '" + bad + "'\n[data]\nkind = 'tokens'\n")
                 .find(bad + "/config.json: eos_token_id: [1,\"x\"] is not a list of token ids") != std::string::npos);
  // A deck that names other end tokens than the config.json contradicts it.
  BOOST_TEST(
      problem_of("[model]\nhf_config = '" + llama31 + "'\neos_token_id = 128009\n[data]\nkind = 'tokens'\n").find("contradicts eos_token_id") !=
      std::string::npos);
}

BOOST_AUTO_TEST_CASE(pretrained_weights_whose_config_json_describes_another_model_are_named) {
  // A deck written by hand (no model.hf_config) beside weights whose config.json says otherwise.
  const std::string folder = hf_folder("pretrained", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "max_position_embeddings": 64, "eos_token_id": 2})");
  const std::string sizes =
      "[model]\nkind = 'llama'\nd_model = 64\nintermediate_size = 128\nn_heads = 4\nn_layers = 2\nn_kv_heads = 2\n"
      "vocab_size = 100\ncontext = 16\n";
  const std::string data = "[data]\nkind = 'tokens'\n";
  auto differences = [&](const std::string& more) {
    return pretrained_config_differences(Deck::parse(sizes + more + data, "a.toml"), folder + "/model.safetensors");
  };
  const auto plain = differences("");
  BOOST_TEST_REQUIRE(plain.has_value());
  BOOST_TEST(plain->file == folder + "/config.json");
  BOOST_TEST((plain->model == std::vector<std::string>{"rope_theta (model.rope_theta): 500000.0 in the file, 10000.0 by the deck"}));
  BOOST_TEST((plain->metadata == std::vector<std::string>{"eos_token_id (model.eos_token_id): 2 in the file, none by the deck",
                                                          "max_position_embeddings (model.max_positions): 64 in the file, 16 by the deck"}));
  // The same values in the deck: nothing to say, for the folder and for its weights alike.
  const auto same = differences("rope_theta = 500000.0\nmax_positions = 64\neos_token_id = 2\n");
  BOOST_TEST_REQUIRE(same.has_value());
  BOOST_TEST(same->model.empty());
  BOOST_TEST(same->metadata.empty());
  BOOST_TEST(pretrained_config_differences(Deck::parse(sizes + "rope_theta = 500000.0\n" + data, "a.toml"), folder)->model.empty());
  // An untied head, another epsilon: each named.
  const auto two = differences("rope_theta = 500000.0\nnorm_eps = 1e-6\ntie_embeddings = false\n");
  BOOST_TEST(two->model.size() == 2u);
  BOOST_TEST(two->model[0].find("rms_norm_eps (model.norm_eps): 1e-05 in the file") == 0u, two->model[0]);
  BOOST_TEST(two->model[1] == "tie_word_embeddings (model.tie_embeddings): true in the file, false by the deck");
  // A Mistral's window, which an export would otherwise drop.
  const std::string mistral =
      hf_folder("pretrained_mistral", R"({"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100, "sliding_window": 32})");
  const auto windowed = pretrained_config_differences(Deck::parse(sizes + data, "a.toml"), mistral);
  BOOST_TEST(std::count_if(windowed->model.begin(), windowed->model.end(), [](const std::string& m) {
               return m.rfind("sliding_window (model.sliding_window): 32 in the file, none by the deck", 0) == 0;
             }) == 1);
  // No config.json: nothing to compare; one this program cannot build: the reader's refusal.
  BOOST_TEST(!pretrained_config_differences(Deck::parse(sizes + data, "a.toml"), folder + "/absent/model.safetensors").has_value());
  const std::string yarn = hf_folder("pretrained_yarn", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})");
  BOOST_CHECK_EXCEPTION(pretrained_config_differences(Deck::parse(sizes + data, "a.toml"), yarn), DeckError,
                        [](const DeckError& e) { return std::string(e.what()).find("type \"yarn\" is not supported") != std::string::npos; });
}

BOOST_AUTO_TEST_CASE(a_hugging_face_config_we_cannot_build_exactly_is_refused_by_name) {
  auto problems_with = [](const std::string& name, const std::string& config, const std::string& more = "") {
    return problems_of("[model]\nhf_config = '" + hf_folder(name, config) + "'\n" + more + "[data]\nkind = 'tokens'\n");
  };
  auto has = [](const std::vector<std::string>& problems, const std::string& text) {
    for (const auto& p : problems)
      if (p.find(text) != std::string::npos) return true;
    BOOST_TEST_MESSAGE("problems: " << problems.size() << (problems.empty() ? "" : ": " + problems[0]));
    return false;
  };
  const std::string sizes = R"("hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100)";
  BOOST_TEST(
      has(problems_with("mixtral", R"({"architectures": ["MixtralForCausalLM"], )" + sizes + "}"),
          "architectures: \"MixtralForCausalLM\" is not supported (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel are)"));
  BOOST_TEST(
      has(problems_with("yarn", R"({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4}, )" + sizes + "}"),
          "rope_scaling: type \"yarn\" is not supported"));
  BOOST_TEST(has(problems_with("obias", R"({"architectures": ["LlamaForCausalLM"], "attention_bias": true, )" + sizes + "}"),
                 "attention_bias: true (biases on q, k, v and o_proj) is not supported"));
  BOOST_TEST(has(problems_with("moe", R"({"architectures": ["Qwen2ForCausalLM"], "num_experts": 8, "num_key_value_heads": 4, )" + sizes + "}"),
                 "num_experts: a mixture of experts"));
  BOOST_TEST(has(problems_with("missing", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})"), "num_hidden_layers: missing"));
  // Mistral's sliding window: exact up to its width, refused beyond it.
  const std::string mistral = R"({"architectures": ["MistralForCausalLM"], "sliding_window": 128, "num_key_value_heads": 2, )" + sizes + "}";
  BOOST_CHECK_NO_THROW(
      Deck::parse("[model]\nhf_config = '" + hf_folder("mistral", mistral) + "'\ncontext = 128\n[data]\nkind = 'tokens'\n", "a.toml"));
  BOOST_TEST(has(problems_with("mistral", mistral, "context = 256\n"), "model.context: 256 is beyond model.sliding_window = 128 (" +
                                                                           hf_folder("mistral", mistral) +
                                                                           "/config.json: sliding_window), which is not supported"));
  // The window is kept for the export: Mistral's architecture; Qwen2's with use_sliding_window on every layer.
  const auto mistral_m = resolve_model_section(
      Deck::parse("[model]\nhf_config = '" + hf_folder("mistral", mistral) + "'\ncontext = 128\n[data]\nkind = 'tokens'\n", "a.toml"));
  BOOST_TEST(mistral_m.sliding_window == 128);
  const auto mistral_json = hf_llama_config(LlamaConfig::of(mistral_m));
  BOOST_TEST(mistral_json.at("architectures").dump() == R"(["MistralForCausalLM"])");
  BOOST_TEST(mistral_json.at("sliding_window") == 128);
  auto qwen2_sw = resolve_model_section(Deck::parse(
      "[model]\nhf_config = '" +
          hf_folder("qwen2_sw",
                    R"({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": true, "num_key_value_heads": 4, )" +
                        sizes + "}") +
          "'\ncontext = 32\n[data]\nkind = 'tokens'\n",
      "a.toml"));
  const auto qwen2_json = hf_llama_config(LlamaConfig::of(qwen2_sw));
  BOOST_TEST(qwen2_json.at("architectures").dump() == R"(["Qwen2ForCausalLM"])");
  BOOST_TEST(qwen2_json.at("use_sliding_window") == true);
  BOOST_TEST(qwen2_json.at("sliding_window") == 32);
  BOOST_TEST(qwen2_json.at("max_window_layers") == 0);
  // Qwen2: q/k/v biases; a window only with use_sliding_window.
  const Deck q = Deck::parse(
      "[model]\nhf_config = '" +
          hf_folder("qwen2", R"({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "num_key_value_heads": 4, )" + sizes + "}") +
          "'\ncontext = 64\n[data]\nkind = 'tokens'\n",
      "a.toml");
  BOOST_TEST(q.get_bool("model.attention_bias"));
  BOOST_TEST(!q.get_bool("model.tie_embeddings"));  // transformers' Qwen2Config default
  BOOST_TEST(q.get_int("model.sliding_window") == 0);
  BOOST_TEST(has(problems_of("[model]\nhf_config = '/nonexistent/folder'\n[data]\nkind = 'tokens'\n"), "/nonexistent/folder: cannot read"));
  // transformers 5's rope_parameters; a llama3 rope needs every one of its keys.
  const auto v5 = resolve_model_section(Deck::parse(
      "[model]\nhf_config = '" +
          hf_folder("v5",
                    R"({"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, )" +
                        sizes + "}") +
          "'\n[data]\nkind = 'tokens'\n",
      "a.toml"));
  BOOST_TEST(v5.rope_theta == 500000.0);
  BOOST_TEST((v5.rope_scaling == RopeScaling::kLlama3));
  BOOST_TEST(v5.rope_scaling_factor == 32.0);
  BOOST_TEST(has(problems_with("v5_partial", R"({"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "llama3",
    "original_max_position_embeddings": 64}, )" + sizes +
                                                 "}"),
                 "rope_parameters: factor: missing"));
  // Mistral without the keys transformers fills with its largest model's values: a 4096 window, KV heads required.
  BOOST_TEST(has(
      problems_with("mistral_default", R"({"architectures": ["MistralForCausalLM"], "num_key_value_heads": 2, )" + sizes + "}", "context = 8192\n"),
      "sliding_window = 4096"));
  BOOST_TEST(has(problems_with("mistral_kv", R"({"architectures": ["MistralForCausalLM"], "sliding_window": null, )" + sizes + "}"),
                 "num_key_value_heads: missing"));
  BOOST_TEST(has(problems_with("notjson", "{not json"), "not a JSON object"));
}

BOOST_AUTO_TEST_CASE(llama3_rope_scaling_and_export_names_and_shard_sizes) {
  const auto l32 = hf_folder("l32", R"({"architectures": ["LlamaForCausalLM"], "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256})");
  const ModelSection m = resolve_model_section(Deck::parse("[model]\nhf_config = '" + l32 + "'\n[data]\nkind = 'tokens'\n", "a.toml"));
  BOOST_TEST((m.rope_scaling == RopeScaling::kLlama3));
  BOOST_TEST(m.rope_scaling_factor == 32.0);
  BOOST_TEST(m.rope_original_context == 8192);
  BOOST_TEST(problem_of("[model]\nkind = 'llama'\nrope_scaling = 'llama3'\nrope_high_freq_factor = 1.0\n[data]\nkind = 'tokens'\n")
                 .find("model.rope_high_freq_factor: must be above model.rope_low_freq_factor") != std::string::npos);
  // Export names: hf for every family with a Hugging Face architecture; hf-gpt2 only for a GPT.
  const Placement one{};
  BOOST_CHECK_NO_THROW(
      resolve_run_config(Deck::parse("[model]\nkind = 'llama'\n[data]\nkind = 'tokens'\n[checkpoint]\nexport_names = 'hf'\n", "a.toml"), one));
  auto config_error = [&](const std::string& text) {
    try {
      resolve_run_config(Deck::parse(text, "a.toml"), one);
    } catch (const DeckError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  BOOST_TEST(config_error("[checkpoint]\nexport_names = 'hf'\n").find("model.kind \"cnn\" has no Hugging Face architecture") != std::string::npos);
  BOOST_TEST(
      config_error("[model]\nkind = 'llama'\n[data]\nkind = 'tokens'\n[checkpoint]\nexport_names = 'hf-gpt2'\n").find("hf-gpt2 names a GPT-2") !=
      std::string::npos);
  BOOST_TEST(
      config_error("[checkpoint]\nexport_max_shard_size = '5 parsecs'\n").find("checkpoint.export_max_shard_size: \"5 parsecs\" is not a size") !=
      std::string::npos);
  BOOST_TEST(*parse_byte_size("5GB") == 5'000'000'000);
  BOOST_TEST(*parse_byte_size("2GiB") == 2147483648);
  BOOST_TEST(*parse_byte_size("500mb") == 500'000'000);
  BOOST_TEST(*parse_byte_size("0") == 0);
  BOOST_TEST(*parse_byte_size("1.5KB") == 1500);
  BOOST_TEST(!parse_byte_size("-1GB"));
  BOOST_TEST(!parse_byte_size("GB"));
}

BOOST_AUTO_TEST_CASE(a_schedule_that_cannot_do_what_the_deck_says_is_warned_about) {
  auto cfg_of = [](const std::string& text) { return resolve_run_config(Deck::parse(text, "inputs/a.toml", {}), placement_of(1, 1)); };
  // inputs/gpt2_finetune.toml as it was on llm.c's tiny Shakespeare: 298 sequences, global batch 32.
  const auto finetune = cfg_of(
      "[run]\nepochs = 1\nmax_steps = 200\n[optim]\nkind = 'adamw'\nwarmup_steps = 20\n[eval]\nevery_steps = 50\n[checkpoint]\nevery_steps = 100\n");
  const auto w = schedule_warnings(finetune, 9, 9, 298, 32, true);
  BOOST_TEST_REQUIRE(w.size() == 4u);
  BOOST_TEST(w[0] ==
             "run.max_steps = 200 cannot be reached: the data gives 9 optimizer steps per epoch (298 training samples, global batch 32) x "
             "run.epochs 1 = 9; the run ends at step 9 (run.epochs = 23 would reach it)");
  BOOST_TEST(w[1] == "eval.every_steps = 50 is beyond the run's 9 steps: one evaluation, after the last step");
  BOOST_TEST(w[2] == "optim.warmup_steps = 20 is not shorter than the run's 9 steps: the learning rate never reaches optim.lr");
  BOOST_TEST(w[3] == "checkpoint.every_steps = 100 is beyond the run's 9 steps: the only checkpoint is the final one");
  BOOST_TEST(schedule_warnings(finetune, 9, 9, 298, 32, false)[1] ==
             "eval.every_steps = 50 asks for evaluation, but there is no validation data (data.val_path is empty): none will run");
  // A deck that does what it says: nothing.
  BOOST_TEST(schedule_warnings(finetune, 200, 200, 6400, 32, true).empty());
}

BOOST_AUTO_TEST_CASE(data_sources_as_an_array_of_tables) {
  // [[data.sources]] blocks and the inline form read alike; unset fields take their defaults (kind:
  // data.kind's, weight 1); the value echoes and round-trips as TOML, and --set takes the inline form.
  const std::string blocks =
      "[model]\nkind = 'transformer'\n[data]\nkind = 'token-shards'\n"
      "[[data.sources]]\npath = 'web/*.bin'\nweight = 3\n[[data.sources]]\npath = 'code'\nkind = 'Indexed'\n";
  const Deck d = Deck::parse(blocks, "inputs/m.toml");
  const Tables& t = d.get_tables("data.sources");
  BOOST_TEST_REQUIRE(t.size() == 2u);
  BOOST_TEST(std::get<std::string>(t[0].at("path")) == "web/*.bin");
  BOOST_TEST(std::holds_alternative<std::monostate>(t[0].at("kind")));
  BOOST_TEST(std::get<double>(t[0].at("weight")) == 3.0);
  BOOST_TEST(std::get<std::string>(t[1].at("kind")) == "indexed");  // choices stored as listed
  BOOST_TEST(std::get<double>(t[1].at("weight")) == 1.0);
  BOOST_TEST(d.entry("data.sources").line == 5);
  const std::string inline_form = "[{ path = \"web/*.bin\", weight = 3.0 }, { path = \"code\", kind = \"indexed\", weight = 1.0 }]";
  BOOST_TEST(format_value(d.entry("data.sources").value) == inline_form);
  BOOST_TEST(d.echo_table().find(inline_form) != std::string::npos);
  const Deck again = Deck::parse(d.to_toml(), "resolved.toml");
  BOOST_TEST((again.entry("data.sources").value == d.entry("data.sources").value));
  const Deck set = Deck::parse("[model]\nkind = 'transformer'\n[data]\nkind = 'token-shards'\n", "inputs/m.toml", {"data.sources=" + inline_form});
  BOOST_TEST((set.entry("data.sources").value == d.entry("data.sources").value));
  const auto cfg = resolve_run_config(d, placement_of(2, 2));
  BOOST_TEST_REQUIRE(cfg.data.sources.size() == 2u);
  BOOST_TEST((cfg.data.sources[0].kind == DataKind::kTokenShards));  // data.kind's
  BOOST_TEST((cfg.data.sources[1].kind == DataKind::kIndexed));
  BOOST_TEST(cfg.data.sources[0].weight == 3.0);
  BOOST_TEST(Deck().get_tables("data.sources").empty());
  BOOST_CHECK_THROW(t[0].at("wieght"), DeckError);

  // Every problem of every table at once, each at its line, named data.sources[i].field.
  const auto problems =
      problems_of("[data]\n[[data.sources]]\npath = 'a'\nweigth = 2\n[[data.sources]]\nkind = 'x'\nweight = -1\n[[data.sources]]\npath = 7\n");
  BOOST_TEST_REQUIRE(problems.size() == 5u, problems.size() << " problems");
  BOOST_TEST(problems[0] == "inputs/a.toml:4: data.sources[0].weigth: unknown field (did you mean weight?)");
  BOOST_TEST(problems[1] == "inputs/a.toml:5: data.sources[1].path: missing (every table of data.sources gives it)");
  BOOST_TEST(problems[2] == "inputs/a.toml:6: data.sources[1].kind: \"x\" is not one of token-shards, indexed");
  BOOST_TEST(problems[3] == "inputs/a.toml:7: data.sources[1].weight: -1 must be greater than 0");
  BOOST_TEST(problems[4] == "inputs/a.toml:9: data.sources[2].path: expected a string, got an integer (7)");
  BOOST_TEST(problem_of("[data]\nsources = ['a']\n") ==
             "inputs/a.toml:2: data.sources[0]: expected a table ({ path = ..., kind = ..., weight = ... }), got a string (\"a\")");
  BOOST_TEST(problem_of("[data]\nsources = 'a'\n") == "inputs/a.toml:2: data.sources: expected an array of tables, got a string (\"a\")");
  BOOST_TEST(problem_of("", {"data.sources=a"}) == "--set data.sources=a: data.sources: expected an array of tables, got a string (\"a\")");

  // Between keys: a mixture of token files only, in place of data.path.
  const std::string lm = "[model]\nkind = 'transformer'\n[data]\n";
  auto config_error = [&](const std::string& text) {
    try {
      resolve_run_config(Deck::parse(text, "inputs/a.toml"), placement_of(1, 1));
    } catch (const DeckError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  BOOST_TEST(config_error(lm + "kind = 'tokens'\nsources = [{ path = 'a' }]\n")
                 .find("data.sources: a mixture of token files needs data.kind \"token-shards\" or \"indexed\" (it is \"tokens\")") !=
             std::string::npos);
  BOOST_TEST(config_error(lm + "kind = 'indexed'\npath = 'x'\nsources = [{ path = 'a' }]\n")
                 .find("inputs/a.toml:5: data.path: give data.path or data.sources, not both") != std::string::npos);
  BOOST_TEST(config_error(lm + "kind = 'indexed'\npath = ''\nsources = [{ path = 'a' }]\n") == "(no error)");
  // A source given twice would be drawn as two: its samples twice per mixture epoch.
  const auto twice = config_error(lm + "kind = 'indexed'\nsources = [{ path = 'a' }, { path = 'b' }, { path = 'a', weight = 2.0 }]\n");
  BOOST_TEST(twice.find("data.sources[2] ('a') is data.sources[0] again: give each source once (with the sum of the weights)") != std::string::npos,
             twice);
  BOOST_TEST(config_error(lm + "kind = 'indexed'\nsources = [{ path = 'a' }, { path = 'a', kind = 'token-shards' }]\n") == "(no error)");
  BOOST_TEST(config_error(lm + "kind = 'indexed'\nsources = [{ path = 'd/a' }, { path = './d/a.idx' }]\n").find("is data.sources[0] again") !=
             std::string::npos);
}

#include "plan/root_unit.hpp"

BOOST_AUTO_TEST_CASE(a_root_unit_that_holds_much_of_the_model_is_named_with_what_avoids_it) {
  // An untied GPT wrapped by its block class only: the embeddings and the head stay in the root, and
  // "auto" (or naming their classes) avoids it. A tied embedding cannot leave the root; NO_WRAP and
  // SHARD_GRAD_OP keep everything gathered by the deck's own choice; a small root is not worth a line.
  auto note = [](const std::string& deck_text, std::int64_t group) {
    const auto cfg = resolve_run_config(Deck::parse(deck_text, "inputs/a.toml"), placement_of(static_cast<int>(group), static_cast<int>(group)));
    const ModelFamily& family = model_family(cfg.model.kind);
    const ModelDesc desc = family.describe(cfg.model);
    WrapDesc wrap;
    wrap.policy = cfg.fsdp.auto_wrap_policy;
    wrap.types = cfg.fsdp.transformer_layer_cls_to_wrap;
    const auto units = plan_units(desc, wrap, group);
    const auto fields = [](const PlanUnit& u) { return UnitFields{u.params, u.numel, u.padded}; };
    const auto facts = root_unit_facts(units, fields, desc, units_freed_between_uses(cfg.fsdp.reshard_after_forward, group),
                                       gathered_param_bytes(cfg.fsdp.mixed_precision), wrap.policy, wrap.types, family.layer_classes(cfg.model));
    return root_unit_note(facts, desc);
  };
  const std::string gpt =
      "[data]\nkind = 'tokens'\n[model]\nkind = 'transformer'\nvocab_size = 8192\nd_model = 64\nn_layers = 2\nn_heads = 2\ncontext = 32\n";
  const std::string blocks = "[fsdp]\nauto_wrap_policy = 'TRANSFORMER_BASED_WRAP'\ntransformer_layer_cls_to_wrap = 'TransformerBlock'\n";
  const auto untied = note(gpt + "tie_embeddings = false\n" + blocks, 4);
  BOOST_TEST_REQUIRE(untied.has_value());
  BOOST_TEST(untied->find("the root unit holds 91% of the parameters") == 0u, *untied);  // 1,050,752 of 1,150,720
  BOOST_TEST(untied->find("(head (LmHead), tok (Embedding))") != std::string::npos, *untied);
  BOOST_TEST(untied->find(": 4.0 MiB per rank besides its shard, and as much again for its gradient in backward") != std::string::npos, *untied);
  const auto bf16 = note(gpt + "tie_embeddings = false\n" + blocks + "mixed_precision = 'bf16'\n", 4);
  BOOST_TEST_REQUIRE(bf16.has_value());
  BOOST_TEST(bf16->find(": 2.0 MiB per rank besides its shard") != std::string::npos, *bf16);  // gathered in bf16
  BOOST_TEST(
      untied->find("transformer_layer_cls_to_wrap = \"auto\" (or adding Embedding, LmHead) makes them units of their own") != std::string::npos,
      *untied);
  BOOST_TEST(!note(gpt + "tie_embeddings = false\n[fsdp]\nauto_wrap_policy = 'TRANSFORMER_BASED_WRAP'\ntransformer_layer_cls_to_wrap = 'auto'\n", 4));
  const auto tied = note(gpt + blocks, 4);
  BOOST_TEST_REQUIRE(tied.has_value());
  BOOST_TEST(tied->find("a tied embedding is used by the first and the last layer and stays in the root") != std::string::npos, *tied);
  BOOST_TEST(!note(gpt + "tie_embeddings = false\n", 4));                                                     // NO_WRAP: one unit, as the deck asks
  BOOST_TEST(!note(gpt + "tie_embeddings = false\n" + blocks + "sharding_strategy = 'SHARD_GRAD_OP'\n", 4));  // every unit stays gathered
  BOOST_TEST(!note(gpt + "tie_embeddings = false\n" + blocks, 1));                                            // one rank: nothing is gathered
  BOOST_TEST(
      !note("[model]\nkind = 'transformer'\nvocab_size = 64\nd_model = 64\nn_layers = 4\nn_heads = 2\ncontext = 32\ntie_embeddings = "
            "false\n[data]\nkind = 'tokens'\n" +
                blocks,
            4));  // a small vocabulary: the root holds little
}
