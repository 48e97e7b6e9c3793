"""What every figure of results/plots.py is drawn with, below the figures: matplotlib and pandas only."""
