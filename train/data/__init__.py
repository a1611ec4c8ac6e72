"""Data building: what a drafter trains on, from raw rows to tokenised samples.

- `dataset`: loading (local files or a hub dataset), chat rendering into ``input_ids`` + ``loss_mask``, packing,
  collation; `chat_render`: the target's chat template and where its assistant turns are;
- `tasks`: training requests per task family (chat, code, Spec-Bench's six), steered and templated;
- `answerer`: the one answerer (the target writes the text its drafter trains on); `target_written` (the hub-free
  chat build), `regenerate` (an existing chat dataset's answers rewritten) and `self_distill` (raw-text
  continuations) hand it their work;
- `text_tier`: conversations and documents the target did not write; `stdlib_samples`: the reference corpus.
"""
