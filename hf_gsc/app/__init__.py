"""A demo app for any saved or Hub detector (the ``demo`` extra: ``pip install 'hf_gsc[demo]'``).

* :mod:`hf_gsc.app.demo`: ``hf-gsc demo --detector PATH_OR_REPO`` starts a Gradio app: drop or paste an image, see the
  base model's top labels, the verdict, the score against the threshold and the ID calibration scores, the p-value,
  and for GSC the map of what the short-circuit changed over the image.
* :mod:`hf_gsc.app.space`: ``hf-gsc space --detector REPO --output DIR`` writes a folder that runs the same app as a
  Hugging Face Space.
"""
