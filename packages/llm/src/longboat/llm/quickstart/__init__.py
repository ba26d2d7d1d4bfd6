"""The quickstart: a corpus and a BPE tokenizer built from the text longboat ships."""
