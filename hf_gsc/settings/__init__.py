"""What a method is called and how it is set: the base every method's settings derive from
(``DetectorConfig``, with the field checks; each method's own class is in its file) and the registry from method name (the saved format's type field) to
detector class. Below the saved format, which reads and writes these settings.
"""
