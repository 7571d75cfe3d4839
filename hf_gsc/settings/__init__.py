"""What a method is called and how it is set: the config hierarchy every method's settings derive from
(``DetectorConfig``, ``GSCConfig``) and the registry from method name (the saved format's type field) to
detector class. Below the saved format, which reads and writes these settings.
"""
