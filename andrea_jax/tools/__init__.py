"""What works on a trained run: sampling, the logit lens, plots, the parameter table, HellaSwag."""
