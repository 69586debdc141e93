# Real token data end to end (docs/interop.md, docs/data.md): llm.c shards (uint16 train over two
# files, uint32 validation), nanoGPT's headerless train.bin and Megatron-LM indexed datasets. In order
# (data.shuffle = false) with one global batch of 6, np 1, 2 and 3 train alike; nanoGPT's file and the
# indexed datasets of the same tokens train bit for bit as the shards; a run stopped inside a shard
# resumes bit for bit at the same world size and within 1e-5 at another; bad files end every rank with
# exit code 2 naming the file and byte offset.
# Variables: MPIEXEC (list), TRAIN, CKPT_TOOL, DECK (inputs/gpt_tokens.toml), PYTHON, WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/data)
include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)
set(make ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/make_token_shards.py)
set(d ${WORK_DIR}/data)

# 3841 tokens over two shards: 240 samples of 16 + 1 tokens (40 steps of 6); the first file ends inside
# sample 120.
run(0 ${make} ${d}/train --tokens 3841 --shards 2)
run(0 ${make} ${d}/val --tokens 801 --seed 2 --format llmc32)
run(0 ${make} ${d}/nano --tokens 3841 --format uint16)
run(0 ${make} ${d}/nanoval --tokens 801 --seed 2 --format uint16)

set(gpt --set data.kind=token-shards --set data.path=${d}/train_*.bin --set data.val_path=${d}/val_*.bin --set data.shuffle=false
        --set model.vocab_size=97 --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set model.dropout=0
        --set optim.kind=sgd --set optim.lr=0.05 --set optim.momentum=0.9 --set optim.weight_decay=0 --set optim.schedule=constant
        --set optim.warmup_steps=0 --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=0)

# 1. One global batch of 6 at np 1, 2 and 3: the same training (SGD, every tensor within 1e-5).
run(0 ${MPIEXEC} -np 1 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=6 --set run.out_dir=${WORK_DIR}/np1)
expect_in("${last_output}" "data token-shards: 240 train, 50 test samples")
expect_in("${last_output}" "\neval loss [0-9.]+, perplexity [0-9.]+ \\(per token\\)\n")  # the end-of-run line of a language model
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/np2)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/np3)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np2/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np3/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)

# 2. nanoGPT's headerless uint16 file of the same tokens: bit for bit the same run.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/nano
    --set data.path=${d}/nano_000000.bin --set data.val_path=${d}/nanoval_000000.bin --set data.token_format=uint16)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/nano/checkpoints ${WORK_DIR}/np2/checkpoints)

# 2b. A Megatron-LM indexed dataset (.bin + .idx) of the same tokens, with the dtype codes Megatron
#    writes (8 uint16, 4 int32): bit for bit the same run; a wrong magic ends every rank naming the index.
run(0 ${make} ${d}/mega16 --tokens 3841 --format megatron)
run(0 ${make} ${d}/mega32 --tokens 3841 --format megatron --dtype-code 4)
run(0 ${make} ${d}/megaval --tokens 801 --seed 2 --format megatron)
foreach(dtype 16 32)
  run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/mega${dtype}
      --set data.kind=indexed --set data.path=${d}/mega${dtype} --set data.val_path=${d}/megaval.idx)
  expect_in("${last_output}" "data indexed: 240 train, 50 test samples")
  run(0 ${CKPT_TOOL} diff ${WORK_DIR}/mega${dtype}/checkpoints ${WORK_DIR}/np2/checkpoints)
endforeach()
run(0 ${make} ${d}/megabad --tokens 500 --format megatron --bad-magic)
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set data.kind=indexed --set data.path=${d}/megabad --set run.out_dir=${WORK_DIR}/bad_mega)
expect_in("${last_output}" "index '[^']*megabad.idx' at byte offset 0: not a Megatron indexed dataset")

# 2c. data.document_mask: documents begin at token 0 (data.eot_token); the run trains at np 2 and 3 to
#    the same weights (within 1e-5), and differently from the run without the mask. The deck's checks:
#    no eot_token, or a model without attention, exit 2 naming the key.
set(docs --set data.document_mask=true --set data.eot_token=0 --set run.max_steps=24 --set data.global_batch_size=6)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${docs} --set run.out_dir=${WORK_DIR}/docs2)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} ${docs} --set run.out_dir=${WORK_DIR}/docs3)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/docs3/checkpoints ${WORK_DIR}/docs2/checkpoints --rtol 1e-5)
run(1 ${CKPT_TOOL} diff ${WORK_DIR}/docs2/checkpoints ${WORK_DIR}/np2/checkpoints --rtol 1e-3)
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set data.document_mask=true --set data.eot_token=97 --set run.out_dir=${WORK_DIR}/docs_bad --dry-run)
expect_in("${last_output}" "data.eot_token: 97 is not below model.vocab_size 97")

# 2c'. The .idx document boundaries in place of a separator: an indexed dataset whose documents each
#    begin with token 96 (and which holds it nowhere else) trains bit for bit alike with data.eot_token
#    = -1 (the .idx says where documents begin, also for the evaluation's batches) and with
#    data.eot_token = 96, at np 2; at np 3 (with activation checkpointing: the recomputed blocks read the
#    same layout) within 1e-5. Without a separator, token-shards exit 2.
run(0 ${make} ${d}/docs --tokens 3841 --format megatron --doc-token 96)
run(0 ${make} ${d}/docsval --tokens 801 --seed 2 --format megatron --doc-token 96)
set(idx_docs --set data.kind=indexed --set data.path=${d}/docs --set data.val_path=${d}/docsval --set data.document_mask=true
             --set run.max_steps=24 --set data.global_batch_size=6 --set eval.every_steps=12)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${idx_docs} --set data.eot_token=96 --set run.out_dir=${WORK_DIR}/docs_eot)
string(REGEX MATCH "step 24: eval loss [0-9.]+" eval_eot "${last_output}")
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${idx_docs} --set run.out_dir=${WORK_DIR}/docs_idx2)
string(REGEX MATCH "step 24: eval loss [0-9.]+" eval_idx "${last_output}")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/docs_idx2/checkpoints ${WORK_DIR}/docs_eot/checkpoints)
if(eval_eot STREQUAL "" OR NOT eval_eot STREQUAL eval_idx)
  message(FATAL_ERROR "evaluation with the .idx boundaries ('${eval_idx}') differs from the separator's ('${eval_eot}')")
endif()
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} ${idx_docs} --set fsdp.activation_checkpointing=true --set run.out_dir=${WORK_DIR}/docs_idx3)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/docs_idx3/checkpoints ${WORK_DIR}/docs_idx2/checkpoints --rtol 1e-5)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${idx_docs} --set data.document_mask=false --set run.out_dir=${WORK_DIR}/docs_none)
run(1 ${CKPT_TOOL} diff ${WORK_DIR}/docs_none/checkpoints ${WORK_DIR}/docs_idx2/checkpoints --rtol 1e-3)
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set data.document_mask=true --set run.out_dir=${WORK_DIR}/docs_bad --dry-run)
expect_in("${last_output}" "data.eot_token: data.document_mask needs the token that begins every document [^\n]*or indexed data")

# 2d. data.sources: a mixture of the llm.c shards (240 samples, weight 3) and a smaller indexed dataset
#    (100 samples, weight 1), shuffled, one global batch of 6 over 3 epochs of the mixture (340
#    samples each): the small source runs through its own epochs. sources.csv gives each source's
#    draws within one sample of its share at every logged step. At np 1 and 2 the same training
#    (within 1e-5); stopped at step 70 (inside the mixture's second epoch and the small source's
#    second) and resumed: at np 2 bit for bit, at np 3 within 1e-5 with the same data: the
#    checkpoint's counters and sources.csv's rows equal the uninterrupted run's, and so does every
#    sample it reads (FSDP_TEST_SAMPLE_LOG); np 4 reads what np 2 reads. A source whose file changed
#    under a checkpoint is refused on every rank naming the source; weights or kinds are checked as
#    deck keys; a bad mixture deck exits 2.
run(0 ${make} ${d}/small --tokens 1601 --seed 3 --format megatron)
set(mix --set data.path= --set data.shuffle=true --set run.epochs=3 --set data.global_batch_size=6 --set log.every_steps=5
        --set "data.sources=[{ path = '${d}/train_*.bin', weight = 3 }, { path = '${d}/small', kind = 'indexed' }]")
file(MAKE_DIRECTORY ${WORK_DIR}/mix2_samples ${WORK_DIR}/mix_resume3_samples)
run(0 ${CMAKE_COMMAND} -E env FSDP_TEST_SAMPLE_LOG=${WORK_DIR}/mix2_samples
    ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=100 --set run.out_dir=${WORK_DIR}/mix2)
expect_in("${last_output}" "data token-shards: 340 train, 50 test samples")
expect_in("${last_output}" "source 1: [^\n]*small \\(indexed\\), 100 samples, weight 1: share 0.2500")
run(0 ${MPIEXEC} -np 1 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=100 --set run.out_dir=${WORK_DIR}/mix1)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/mix1/checkpoints ${WORK_DIR}/mix2/checkpoints --rtol 1e-5)
run(0 ${PYTHON} -c "
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
steps = sorted({int(r['step']) for r in rows})
assert steps == list(range(5, 101, 5)), steps
for step in steps:
    at = [r for r in rows if int(r['step']) == step]
    total = sum(int(r['drawn']) for r in at)
    for r in at:
        off = abs(int(r['drawn']) - float(r['share']) * total)
        assert off < 1, (step, r, total)
        assert int(r['drawn']) == int(r['source_epoch']) * (240 if r['source'] == '0' else 100) + int(r['source_position']), r
last = [r for r in rows if int(r['step']) == 100]
assert int(last[1]['source_epoch']) == 1 and int(last[0]['source_epoch']) == 1, last  # both sources in their second epoch
s = json.load(open(sys.argv[2]))['data_sources']
assert [x['drawn'] for x in s] == [int(r['drawn']) for r in last], (s, last)
print('mixture: draws', [int(r['drawn']) for r in last], 'of', sum(int(r['drawn']) for r in last), 'shares within one sample at', len(steps), 'logged steps')
" ${WORK_DIR}/mix2/sources.csv ${WORK_DIR}/mix2/summary.json)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=70 --set run.out_dir=${WORK_DIR}/mix_resume2)
file(COPY ${WORK_DIR}/mix_resume2/ DESTINATION ${WORK_DIR}/mix_resume3)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=100 --set run.out_dir=${WORK_DIR}/mix_resume2)
expect_in("${last_output}" "resumed from [^\n]*step_00000070.h5 at step 70")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/mix_resume2/checkpoints ${WORK_DIR}/mix2/checkpoints)
run(0 ${CMAKE_COMMAND} -E env FSDP_TEST_SAMPLE_LOG=${WORK_DIR}/mix_resume3_samples
    ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=100 --set run.out_dir=${WORK_DIR}/mix_resume3)
expect_in("${last_output}" "resumed from [^\n]*step_00000070.h5 at step 70")
# What the resumed run at np 3 read, sample by sample, is what the uninterrupted run at np 2 read at
# the same places of the same epochs (FSDP_TEST_SAMPLE_LOG: "epoch position sample" per rank).
run(0 ${PYTHON} -c "
import glob, sys
def read(d):
    out = {}
    for f in glob.glob(d + '/samples.*'):
        for line in open(f):
            e, p, s = map(int, line.split())
            out[(e, p)] = s
    return out
whole, resumed = read(sys.argv[1]), read(sys.argv[2])
assert len(resumed) == 30 * 6, len(resumed)  # steps 71-100, 6 samples each
assert min(resumed) == (1, 14 * 6), min(resumed)  # step 70 stopped 14 steps into the second epoch (the first took 56: its whole global batches)
differ = [k for k in resumed if whole.get(k) != resumed[k]]
assert not differ, differ[:5]
print('np 3 after the resume read the same', len(resumed), 'samples as np 2 without one')
" ${WORK_DIR}/mix2_samples ${WORK_DIR}/mix_resume3_samples)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/mix_resume3/checkpoints ${WORK_DIR}/mix2/checkpoints --rtol 1e-5)
foreach(run_dir mix2 mix_resume3)
  run(0 ${CKPT_TOOL} inspect ${WORK_DIR}/${run_dir}/checkpoints)
  string(REGEX MATCHALL "train/[a-z_0-9/]+ +[0-9]+" counters_${run_dir} "${last_output}")
endforeach()
expect_in("${counters_mix2}" "train/data/source_1_epoch +1;")
if(NOT counters_mix2 STREQUAL counters_mix_resume3)
  message(FATAL_ERROR "the mixture's counters differ after a resume at np 3:\n${counters_mix_resume3}\nuninterrupted:\n${counters_mix2}")
endif()
file(STRINGS ${WORK_DIR}/mix2/sources.csv whole_rows REGEX "^(7[5-9]|[89][0-9]|100),")
file(STRINGS ${WORK_DIR}/mix_resume3/sources.csv resumed_rows REGEX "^(7[5-9]|[89][0-9]|100),")
if(NOT whole_rows STREQUAL resumed_rows)
  message(FATAL_ERROR "sources.csv after the resume at np 3 differs from the uninterrupted run's")
endif()
# At np 4 (a global batch of 12, 3 per rank) the mixture trains as at np 2 (6 per rank) through an
# epoch's end (after step 28): the same samples at the same places, the weights within 1e-5.
file(MAKE_DIRECTORY ${WORK_DIR}/mix12_2_samples ${WORK_DIR}/mix12_4_samples)
foreach(np 2 4)
  run(0 ${CMAKE_COMMAND} -E env FSDP_TEST_SAMPLE_LOG=${WORK_DIR}/mix12_${np}_samples ${MPIEXEC} -np ${np} ${TRAIN} ${DECK} ${gpt} ${mix}
      --set data.global_batch_size=12 --set run.max_steps=40 --set run.out_dir=${WORK_DIR}/mix12_${np})
endforeach()
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/mix12_4/checkpoints ${WORK_DIR}/mix12_2/checkpoints --rtol 1e-5)
run(0 ${PYTHON} -c "
import glob, sys
def read(d):
    out = {}
    for f in glob.glob(d + '/samples.*'):
        for line in open(f):
            e, p, s = map(int, line.split())
            out[(e, p)] = s
    return out
two, four = read(sys.argv[1]), read(sys.argv[2])
assert len(two) == 28 * 12 + 12 * 12 and two == four, (len(two), len(four))  # 340 samples: 28 whole global batches an epoch
print('np 4 read the same', len(four), 'samples as np 2')
" ${WORK_DIR}/mix12_2_samples ${WORK_DIR}/mix12_4_samples)
file(COPY ${WORK_DIR}/mix_resume2/ DESTINATION ${WORK_DIR}/mix_changed)
run(0 ${make} ${d}/small --tokens 2001 --seed 3 --format megatron)  # the source grew under the checkpoint
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${mix} --set run.max_steps=110 --set run.out_dir=${WORK_DIR}/mix_changed)
expect_in("${last_output}" "the mixture of data.sources does not stand where the checkpoint's stopped")
expect_in("${last_output}" "data.sources\\[1\\] \\('[^']*small'\\) source_1_samples: 100 in the checkpoint, 125 with this deck and data")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/mix_bad --set data.path= --dry-run
    --set "data.sources=[{ path = '${d}/small', kind = 'indexed', weight = 0 }]")
expect_in("${last_output}" "data.sources\\[0\\].weight: 0 must be greater than 0")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/mix_bad --set data.path= --set "data.sources=[{ path = '${d}/none_*.bin' }]")
expect_in("${last_output}" "data.sources\\[0\\] \\('[^']*none_\\*.bin'\\): [^\n]*none_")

# 3. Stopped after step 21 (sample 126, inside the second shard) and resumed: at np 2 bit for bit; at
#    np 3 with the same global batch within 1e-5.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=21 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/resume2)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/resume2)
expect_in("${last_output}" "resumed from [^\n]*step_00000021.h5 at step 21")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/resume2/checkpoints ${WORK_DIR}/np2/checkpoints)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=21 --set data.global_batch_size=6 --set run.out_dir=${WORK_DIR}/resume3)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.global_batch_size=6 --set run.out_dir=${WORK_DIR}/resume3)
expect_in("${last_output}" "resumed from [^\n]*step_00000021.h5 at step 21")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/resume3/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)
# 3b. Files added under the glob of data.path after the checkpoint (another sample count: every later
#     sample and the epoch's end move): refused on every rank naming the counts; "allow" goes on and warns.
file(MAKE_DIRECTORY ${WORK_DIR}/grown_data)
file(COPY ${d}/train_000000.bin DESTINATION ${WORK_DIR}/grown_data)
set(grown ${gpt} --set data.path=${WORK_DIR}/grown_data/train_*.bin --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/grown)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${grown} --set run.max_steps=4)
file(COPY ${d}/train_000001.bin DESTINATION ${WORK_DIR}/grown_data)
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${grown} --set run.max_steps=6)
expect_in("${last_output}" "the training data does not stand where the checkpoint's stopped \\(its files changed: the samples under data.path, or a text's characters\\):\n  data.path \\('[^']*grown_data/train_\\*.bin'\\) data_path_samples: [0-9]+ in the checkpoint, 240 with this deck and data")
expect_not_in("${last_output}" "resumed from")  # a refused resume does not say it resumed
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${grown} --set run.max_steps=6 --set checkpoint.resume_changed=allow)
expect_in("${last_output}" "warning: the training data continues from another position")
# 3c. Another world size without data.global_batch_size: 2 ranks x 3 become 4 ranks x 3. Step 4 (24
#     samples) is a step boundary of both, but the global batch doubles: refused, naming both and the
#     key; "allow" goes on and ends at the end of the data (step 4 + 240 / 12 - 24 / 12 = 22), and a
#     rerun finds the run finished.
set(regrouped ${gpt} --set data.batch_size=3 --set run.epochs=1 --set run.out_dir=${WORK_DIR}/regrouped)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=4)
run(2 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=0)
expect_in("${last_output}" "the checkpoint resumed from was trained with global batches of 6 samples, this run's are 12 \\(data.batch_size 3 x 4 ranks x optim.grad_accum_steps 1\\): its 6 samples do not divide over 4 ranks: run on a world size that divides 6 with data.global_batch_size = 6, or checkpoint.resume_changed = \"allow\" to go on with 12")
#     A checkpoint off the new batch's step boundary is refused even then, before any warning, naming
#     the batch it was trained with.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=3 --set run.out_dir=${WORK_DIR}/offstep)
run(2 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=0 --set checkpoint.resume_changed=allow --set run.out_dir=${WORK_DIR}/offstep)
expect_in("${last_output}" "stopped 18 samples into epoch 1, not a whole number of this run's global batches of 12 \\(data.batch_size 3 x 4 ranks x optim.grad_accum_steps 1\\): its 6 samples do not divide over 4 ranks")
expect_not_in("${last_output}" "warning: the checkpoint resumed from")
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=0 --set checkpoint.resume_changed=allow)
expect_in("${last_output}" "step 22/22")
file(READ ${WORK_DIR}/regrouped/summary.json regrouped_summary)
expect_in("${regrouped_summary}" "\"steps\": 22,")
expect_in("${regrouped_summary}" "\"global batch: 6 -> 12\"")
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${regrouped} --set run.max_steps=0 --set checkpoint.resume_changed=allow)
expect_in("${last_output}" "nothing to train: the run in [^\n]* already reached step 22 of 22")
# 3d. data.kind "text" whose file changed after the checkpoint: a character added before the others
#     renumbers every token id. Refused, naming the text's vocabulary.
string(REPEAT "the quick brown fox jumps over the lazy dog. " 20 book)
file(WRITE ${WORK_DIR}/book.txt "${book}")
set(text --set data.kind=text --set data.path=${WORK_DIR}/book.txt --set data.shuffle=false --set model.vocab_size=64 --set model.d_model=32
         --set model.n_layers=2 --set model.context=16 --set model.dropout=0 --set optim.kind=sgd --set optim.schedule=constant
         --set optim.warmup_steps=0 --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=0 --set data.batch_size=3
         --set run.out_dir=${WORK_DIR}/text)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${text} --set run.max_steps=2)
file(WRITE ${WORK_DIR}/book.txt "!${book}")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${text} --set run.max_steps=4)
expect_in("${last_output}" "data.path \\('[^']*book.txt'\\) text_vocabulary: [0-9]+ in the checkpoint, [0-9]+ with this deck and data")

# 4. Evaluation every 5 steps on 2 batches of the validation shard: loss and perplexity in metrics.csv,
#    the progress and summary.json; the trained weights are those of the run without it, bit for bit.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/eval
    --set eval.every_steps=5 --set eval.max_batches=2 --set log.every_steps=4 --set data.test_batch_size=4)
expect_in("${last_output}" "epoch 1 step 5: eval loss [0-9.]+, perplexity [0-9.]+, accuracy [0-9.]+% \\(256 tokens\\)")
expect_in("${last_output}" "epoch 1 step 24: eval loss")
expect_in("${last_output}" "tokens/s")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/eval/checkpoints ${WORK_DIR}/np2/checkpoints)
file(STRINGS ${WORK_DIR}/eval/metrics.csv rows)
list(GET rows 0 header)
expect_in("${header}" "^step,epoch,loss,lr,samples_per_s,step_ms,elapsed_s,eval_loss,eval_ppl,forward_ms,backward_ms,optimizer_ms,all_gather_ms,reduce_scatter_ms,all_reduce_ms,minor_faults,loss_scale,skipped_in_window,rss_mib,slowest_rank,others_waited_ms,tokens_per_s,mfu$")
expect_in("${rows}" ";5,1,,,,,,[0-9.]+,[0-9.]+,,,,,,,,,,,,,,;")     # an evaluation after a step without a log row
expect_in("${rows}" ";20,1,[0-9.]+,[^;]*,[0-9.]+,[0-9.]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9]+,,0,[0-9.]+,[01],[0-9.e+-]+,[0-9.e+-]+,[0-9][0-9.e-]*;")  # a logged step with its evaluation
expect_in("${rows}" ";8,1,[0-9.]+,[^;]*,,,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9]+,,0,[0-9.]+,[01],[0-9.e+-]+,[0-9.e+-]+,[0-9][0-9.e-]*;")  # a logged step without one (tokens/s, then MFU)
file(READ ${WORK_DIR}/eval/summary.json summary)
foreach(key "eval_step.: 24," "eval_perplexity.: [0-9]" "test_loss.: [0-9]" "tokens_per_s.: [0-9]" "model_flops_per_s.: [0-9]")
  expect_in("${summary}" "${key}")
endforeach()

# 4c. --eval-only on the finished run of (4): its latest checkpoint evaluated on the whole validation
#    split at np 3, and the same weights exported and read through checkpoint.init_from at np 1, give
#    the same loss (within 1e-6); the result joins summary.json under "eval_only", leaving the training
#    figures, the checkpoints and deck.toml as they were. checkpoint.resume names another checkpoint.
#    Nothing to evaluate, or no validation data: exit 2 on every rank.
file(SHA256 ${WORK_DIR}/eval/deck.toml deck_before)
file(GLOB ckpts_before ${WORK_DIR}/eval/checkpoints/*)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/eval --eval-only)
expect_in("${last_output}" "eval-only: [^\n]*step_00000024.h5 \\(step 24\\): eval loss [0-9.]+, perplexity [0-9.]+ \\(per token\\), accuracy [0-9.]+%, 800 tokens, [0-9]+ tokens/s")
file(SHA256 ${WORK_DIR}/eval/deck.toml deck_after)
file(GLOB ckpts_after ${WORK_DIR}/eval/checkpoints/*)
if(NOT deck_before STREQUAL deck_after OR NOT ckpts_before STREQUAL ckpts_after)
  message(FATAL_ERROR "--eval-only changed deck.toml or the checkpoints: ${ckpts_before} -> ${ckpts_after}")
endif()
run(0 ${CKPT_TOOL} export ${WORK_DIR}/eval/checkpoints/step_00000024.h5 ${WORK_DIR}/eval_export.safetensors)
run(0 ${MPIEXEC} -np 1 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/eval_fresh --eval-only --set checkpoint.init_from=${WORK_DIR}/eval_export.safetensors)
expect_in("${last_output}" "eval-only: [^\n]*eval_export.safetensors: eval loss")
run(0 ${PYTHON} -c "
import json, sys
s = json.load(open('${WORK_DIR}/eval/summary.json'))
e, fresh = s['eval_only'], json.load(open('${WORK_DIR}/eval_fresh/summary.json'))['eval_only']
if 'test_loss' not in s or s['eval_step'] != 24: sys.exit('the training figures of summary.json are gone: ' + str(list(s)))
if e['tokens'] != 800 or e['world_size'] != 3 or not e['model'].endswith('(step 24)'): sys.exit('eval_only: ' + str(e))
print('eval-only of step 24 at np 3:', e['loss'], 'of its export at np 1:', fresh['loss'])
if abs(e['loss'] - fresh['loss']) > 1e-6 * abs(fresh['loss']): sys.exit('the two evaluations differ')
")
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/eval --eval-only --set checkpoint.resume=${WORK_DIR}/resume2/checkpoints/step_00000021.h5)
expect_in("${last_output}" "eval-only: [^\n]*step_00000021.h5 \\(step 21\\): eval loss")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/eval_nothing --eval-only)
expect_in("${last_output}" "--eval-only: nothing to evaluate: no checkpoint in [^\n]*eval_nothing/checkpoints and checkpoint.init_from is empty")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/eval --eval-only --set data.val_path=)
expect_in("${last_output}" "--eval-only: there is no validation data")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/bad_val --set data.val_path=${d}/missing_*.bin --dry-run)
expect_in("${last_output}" "data.val_path: no token files match '[^']*missing_\\*.bin'")

# 6. Gradients in fp16 with dynamic loss scaling (fsdp.mixed_precision = fp16_reduce: fp32 compute,
#    gradients reduced in fp16; fp16 arithmetic itself needs a GPU, and asking for it here is a deck
#    error) train the GPT as well as bf16 does: over 300 steps of AdamW the final training loss of each
#    is within 3% of fp32's. A first scale of 2^30 overflows fp16 at once: the steps are skipped (counted
#    in summary.json and metrics.csv) and the scale backs off until it fits, and the run still ends
#    within 3% of fp32. A run stopped at step 150 resumes with the saved scale bit for bit (a scale that
#    grows every 20 good steps: a lost scale would change the result).
set(precision --set data.kind=tokens --set data.num_samples=2400 --set data.batch_size=4 --set data.test_samples=64
              --set model.vocab_size=64 --set model.d_model=32 --set model.n_heads=2 --set model.n_layers=2 --set model.context=16
              --set model.dropout=0 --set run.epochs=1 --set run.max_steps=300 --set optim.warmup_steps=10 --set optim.lr=0.01
              --set log.every_steps=10 --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=0)
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} --set fsdp.mixed_precision=fp16 --set run.out_dir=${WORK_DIR}/fp16_cpu --dry-run)
expect_in("${last_output}" "fsdp.mixed_precision: fp16 computes in half precision, which LibTorch's CPU kernels do not implement")
foreach(mp no bf16 fp16_reduce)
  run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${precision} --set fsdp.mixed_precision=${mp} --set run.out_dir=${WORK_DIR}/mp_${mp})
endforeach()
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${precision} --set fsdp.mixed_precision=fp16_reduce --set fsdp.loss_scale_init=1073741824
    --set run.out_dir=${WORK_DIR}/mp_fp16_overflow)
run(0 ${PYTHON} -c "
import json, sys
loss = lambda name: json.load(open('${WORK_DIR}/' + name + '/summary.json'))['final_train_loss']
base = loss('mp_no')
for name in ('mp_bf16', 'mp_fp16_reduce', 'mp_fp16_overflow'):
    ratio = loss(name) / base
    print(name, 'final loss', loss(name), 'fp32', base, 'ratio', round(ratio, 4))
    if abs(ratio - 1) > 0.03: sys.exit(name + ': final training loss not within 3% of fp32')
s = json.load(open('${WORK_DIR}/mp_fp16_overflow/summary.json'))
if not (s['overflow_steps'] >= 10 and s['skipped_steps'] == s['overflow_steps'] and s['loss_scale'] <= 65536):
    sys.exit('expected at least 10 overflowed steps and a scale backed off to 2^16 or less: ' + str(s))
if 'loss_scale' in json.load(open('${WORK_DIR}/mp_bf16/summary.json')): sys.exit('bf16 has no loss scale')
")
file(STRINGS ${WORK_DIR}/mp_fp16_overflow/metrics.csv rows)
expect_in("${rows}" ";10,1,[^;]*,[0-9]+,[0-9.e+-]+,[1-9][0-9]*,[0-9.]+,[0-9]+,[0-9.e+-]+,[0-9.e+-]+,[0-9][0-9.e-]*;")  # the first row: its loss scale, steps skipped since the start
set(growing --set fsdp.mixed_precision=fp16_reduce --set fsdp.loss_scale_growth_interval=20 --set checkpoint.save_final=true
            --set optim.schedule=constant)  # a cosine would follow each run's own max_steps
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${precision} ${growing} --set run.out_dir=${WORK_DIR}/fp16_whole)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${precision} ${growing} --set run.max_steps=150 --set run.out_dir=${WORK_DIR}/fp16_resumed)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${precision} ${growing} --set run.out_dir=${WORK_DIR}/fp16_resumed)
expect_in("${last_output}" "resumed from [^\n]*step_00000150.h5 at step 150")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/fp16_resumed/checkpoints ${WORK_DIR}/fp16_whole/checkpoints)
run(0 ${PYTHON} -c "
import json, sys
whole, resumed = (json.load(open('${WORK_DIR}/' + n + '/summary.json')) for n in ('fp16_whole', 'fp16_resumed'))
if whole['loss_scale'] != resumed['loss_scale']: sys.exit('loss scale %r after the resume, %r uninterrupted' % (resumed['loss_scale'], whole['loss_scale']))
if whole['loss_scale'] == 2.0 ** 16: sys.exit('the scale never moved: the resume check proves nothing')
")

# 4b. Evaluation in chunks runs as many forwards as the rank's share of the test set needs, whatever
#    data.test_batch_size says: a vocabulary of 300000 makes each chunk one sequence (its logits exceed
#    a third of the 32 MiB budget); 8 test sequences over 2 ranks take 4 chunked forwards per rank with
#    a test batch of 1000 as with one of 4, so both runs all-gather the same bytes.
set(wide --set data.kind=tokens --set data.num_samples=64 --set data.batch_size=2 --set data.test_samples=8 --set model.vocab_size=300000
         --set model.d_model=8 --set model.n_heads=2 --set model.n_layers=1 --set model.context=16 --set model.dropout=0 --set run.max_steps=1
         --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=0 --set checkpoint.save_final=false)
foreach(test_batch 4 1000)
  run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${wide} --set data.test_batch_size=${test_batch} --set run.out_dir=${WORK_DIR}/chunks${test_batch})
  expect_in("${last_output}" "eval loss [0-9.]+")
  file(READ ${WORK_DIR}/chunks${test_batch}/summary.json chunk_summary)
  string(JSON gathered${test_batch} GET "${chunk_summary}" comm all_gather bytes)
endforeach()
if(NOT gathered4 EQUAL gathered1000)
  message(FATAL_ERROR "evaluation with data.test_batch_size 1000 all-gathered ${gathered1000} bytes, with 4 ${gathered4}: empty chunks were run")
endif()

# 5. Bad files: every rank exits 2, the message names the file (and the byte offset).
run(0 ${make} ${d}/magic --tokens 500 --bad-magic)
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set data.path=${d}/magic_*.bin --set run.out_dir=${WORK_DIR}/bad_magic)
expect_in("${last_output}" "magic_000000.bin': magic 12345 at byte offset 0")
run(0 ${make} ${d}/vocab --tokens 3841 --shards 2 --bad-token 3000)
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set data.path=${d}/vocab_*.bin --set run.out_dir=${WORK_DIR}/bad_vocab)
# Token 3000 is token 1079 of the second file (1921 in the first): byte offset 1024 + 2 * 1079.
expect_in("${last_output}" "token 97 in file '[^']*vocab_000001.bin' at byte offset 3182 is not below model.vocab_size 97")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set data.path=${d}/nothing_*.bin --set run.out_dir=${WORK_DIR}/bad_glob)
expect_in("${last_output}" "no token files match '[^']*nothing_\\*.bin'")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set data.path=${d}/nano_000000.bin --set run.out_dir=${WORK_DIR}/bad_format)
expect_in("${last_output}" "nano_000000.bin")
