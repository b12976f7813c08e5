"""`python _convert.py TREE PRE [convert_hf_to_gguf.py arguments]`: llama.cpp's converter from the source tree
TREE, with the BPE pre-tokenizer named PRE instead of the one its hash lookup finds.

The converter names a checkpoint's pre-tokenizer (the regex splits before BPE) by hashing the ids of a test
string, and refuses hashes it does not list, as the zoo tokenizer's. Its split rules are those of the `starcoder`
entry (loadtest/peer/gguf.py). The lookup is replaced in this process only; the tree on disk is left as it is.
Run with PYTHONPATH=TREE/gguf-py (loadtest/peer/gguf.py does).
"""

import runpy
import sys

if __name__ == "__main__":
    tree, pre, *args = sys.argv[1:]
    sys.path.insert(0, tree)
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [f"{tree}/convert_hf_to_gguf.py", *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
