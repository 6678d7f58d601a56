"""Developer tools: check-graph (graphcheck/), the programs a config compiles (programs.py: the engines'
inventories lowered from a config, and the batch-size grid; vision_programs.py), export, the Neuron bring-up doctor, size and collective accounting."""
