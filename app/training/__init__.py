"""What makes the zoo: corpus, synthetic snippets, tokenizer training, the train loop, probes, reports.

Serving code never imports this package (tests/test_layering.py checks it).
"""
