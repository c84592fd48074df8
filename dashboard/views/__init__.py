"""The dashboard's pages, run by ``dashboard/app.py`` through ``st.navigation``.

The folder is not called ``pages/``: Streamlit would auto-discover that one and list
every file in the sidebar before ``st.navigation`` takes over.
"""
