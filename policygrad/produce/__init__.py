"""The producer: prompts in, sampled and scored groups out (a step's sample stage), inline or
ahead of training on a thread."""
