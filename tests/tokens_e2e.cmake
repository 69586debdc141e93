# Real token data end to end (docs/interop.md): llm.c shards (uint16 train over two files, uint32
# validation) and nanoGPT's headerless train.bin. In order (data.shuffle = false) with one global batch
# of 6, np 1, 2 and 3 train alike; nanoGPT's file of the same tokens trains bit for bit as the shards;
# a run stopped inside a shard resumes bit for bit at the same world size and within 1e-5 at another;
# bad files end every rank with exit code 2 naming the file and byte offset.
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
expect_in("${last_output}" "test loss [0-9.]+")
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/np2)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/np3)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np2/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np3/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)

# 2. nanoGPT's headerless uint16 file of the same tokens: bit for bit the same run.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=24 --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/nano
    --set data.path=${d}/nano_000000.bin --set data.val_path=${d}/nanoval_000000.bin --set data.token_format=uint16)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/nano/checkpoints ${WORK_DIR}/np2/checkpoints)

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
expect_in("${header}" "^step,epoch,loss,lr,samples_per_s,step_ms,elapsed_s,eval_loss,eval_ppl,forward_ms,backward_ms,optimizer_ms,all_gather_ms,reduce_scatter_ms,all_reduce_ms,minor_faults$")
expect_in("${rows}" ";5,1,,,,,,[0-9.]+,[0-9.]+,,,,,,,;")     # an evaluation after a step without a log row
expect_in("${rows}" ";20,1,[0-9.]+,[^;]*,[0-9.]+,[0-9.]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9]+;")  # a logged step with its evaluation
expect_in("${rows}" ";8,1,[0-9.]+,[^;]*,,,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9]+;")             # a logged step without one
file(READ ${WORK_DIR}/eval/summary.json summary)
foreach(key "eval_step.: 24," "eval_perplexity.: [0-9]" "test_loss.: [0-9]" "tokens_per_s.: [0-9]" "model_flops_per_s.: [0-9]")
  expect_in("${summary}" "${key}")
endforeach()

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
