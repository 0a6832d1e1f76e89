"""Data pipeline: corpus -> tokenizer -> packed token shards -> resumable loader.

- `corpus`: where documents come from (offline Shakespeare scenes, local files, hub) and the hashed val split
- `tokenizer`: byte-level BPE training/loading, BOS, bytes per token id
- `shards`: the on-disk format (documented there), the index schema (`check_index`), shard writer, part indexes,
  merge/commit, verified opening (`open_shard`, `open_split`)
- `prepare`: `nagmoe prepare-data` (single pass and the sharded job-array protocol)
- `loader`: `TokenLoader` (training batches), `iter_eval_batches`, `check_data_vocab`
- `bpb`: bits-per-byte sums, bytes per token, the unigram baseline
Importing `loader` needs neither `datasets` nor `tokenizers` (the GPU machine has pre-tokenized data).
"""
