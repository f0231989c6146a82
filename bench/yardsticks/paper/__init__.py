"""The accuracy yardstick on the xMem paper's measured jobs: ``jobs`` rebuilds each job as a
training script (torchvision and Hugging Face ``from_config`` models, configs in ``hf_configs``),
``benchmark`` estimates the rows through ``xmem estimate``'s path and compares the estimators.
"""
