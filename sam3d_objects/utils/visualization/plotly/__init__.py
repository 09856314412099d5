"""plotly scene plots (plotly is optional: `pip install plotly`)."""
